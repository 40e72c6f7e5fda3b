"""Live-server benchmarks on the zero-cost engine (``--time-scale inf``): what the router adds.

1. **Router overhead** (target: p50 <= 1 ms). One request at a time, 8 output tokens:
   (a) HTTP ``POST /generate`` through ``launch --dp 1`` (HTTP parse, identity,
   tokenization, D2LPM dispatch, zmq to the worker and back, response), against
   (b) the same request sent straight to a worker process over its zmq socket (Dispatch
   in, Finished out), with no HTTP and no router. Overhead = p50(a) − p50(b); it includes
   the HTTP client's own cost, so it is an upper bound on what the router adds.
2. **Throughput** (target: >= 2,000 req/s). Short requests (16-token prompt, 4 output
   tokens) from ``CONCURRENCY`` keep-alive connections (aiohttp, one process) through
   ``launch --dp 2``, for ``SECONDS`` seconds; the load generator shares the 2 cores.

Run: ``.venv/bin/python bench/bench_live.py [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sgl_fair.metrics import percentiles

N_LATENCY = 2000
CONCURRENCY = 64
SECONDS = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "sgl_fair.launch", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {Path(self.log.name).read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("server did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)


def http_latencies(url: str, n: int) -> list[float]:
    host, port = url[len("http://") :].split(":")
    conn = http.client.HTTPConnection(host, int(port))
    body = json.dumps({"input_ids": list(range(1, 17)), "sampling_params": {"max_new_tokens": 8}})
    hdr = {"Content-Type": "application/json"}
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        conn.request("POST", "/generate", body, hdr)
        resp = conn.getresponse()
        data = resp.read()
        dt = time.perf_counter() - t
        assert resp.status == 200, data
        if i >= 100:  # warm-up
            out.append(dt)
    conn.close()
    return out


def direct_latencies(n: int) -> list[float]:
    """Dispatch -> Finished straight to a worker process over zmq (no HTTP, no router)."""
    import multiprocessing

    import zmq

    from sgl_fair.messages import Dispatch, Finished, Hello, Shutdown
    from sgl_fair.request import Request
    from sgl_fair.transport import Endpoints, decode, encode
    from sgl_fair.worker.live import LiveWorkerConfig, worker_main

    ipc = tempfile.mkdtemp(prefix="sgl-fair-bench-")
    ep = Endpoints.ipc(ipc)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(ep.router_in)
    push = ctx.socket(zmq.PUSH)
    push.bind(ep.worker_in(0))
    cfg = LiveWorkerConfig(wid=0, endpoints=ep.base, time_scale=float("inf"))
    proc = multiprocessing.get_context("spawn").Process(target=worker_main, args=(cfg,))
    proc.start()
    while not isinstance(decode(pull.recv()), Hello):
        pass
    out = []
    try:
        for i in range(n + 100):
            req = Request(f"r{i}", "c", tuple(range(1, 17)), 8, time.time())
            t = time.perf_counter()
            push.send(encode(Dispatch(0, req, time.time())))
            while True:
                msg = decode(pull.recv())
                if isinstance(msg, Finished) and msg.rid == req.rid:
                    break
            if i >= 100:
                out.append(time.perf_counter() - t)
    finally:
        push.send(encode(Shutdown(0)))
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        ctx.destroy(linger=0)
    return out


async def _throughput(url: str, seconds: float, concurrency: int) -> tuple[int, int, float]:
    import aiohttp

    body = json.dumps({"input_ids": list(range(1, 17)), "sampling_params": {"max_new_tokens": 4}})
    done = 0
    errors = 0
    stop_at = 0.0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            async with session.post(
                url + "/generate", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
                else:
                    errors += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        stop_at = time.perf_counter() + 1.0  # warm-up
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        done = errors = 0
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return done, errors, elapsed


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    }
    direct = direct_latencies(N_LATENCY)
    srv = Server("--dp", "1", "--time-scale", "inf")
    try:
        via = http_latencies(srv.url, N_LATENCY)
    finally:
        srv.stop()
    d, v = percentiles(direct), percentiles(via)
    res["latency"] = {
        "direct_zmq_p50_ms": 1e3 * d[50],
        "via_router_http_p50_ms": 1e3 * v[50],
        "via_router_http_p99_ms": 1e3 * v[99],
        "overhead_p50_ms": 1e3 * (v[50] - d[50]),
        "target_p50_ms": 1.0,
    }
    srv = Server("--dp", "2", "--time-scale", "inf")
    try:
        done, errors, elapsed = asyncio.run(_throughput(srv.url, SECONDS, CONCURRENCY))
    finally:
        srv.stop()
    res["throughput"] = {
        "req_per_s": done / elapsed,
        "errors": errors,
        "concurrency": CONCURRENCY,
        "seconds": elapsed,
        "target_req_per_s": 2000,
    }
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        lat, thr = res["latency"], res["throughput"]
        print(
            f"router overhead p50 {lat['overhead_p50_ms']:.3f} ms (via router "
            f"{lat['via_router_http_p50_ms']:.3f} ms, direct {lat['direct_zmq_p50_ms']:.3f} ms)"
        )
        print(f"throughput {thr['req_per_s']:.0f} req/s ({thr['errors']} errors)")
    return res


if __name__ == "__main__":
    main()
