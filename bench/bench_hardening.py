"""Hardening at full scale (issue 16, items 1, 4, 6 and 8): bursts, idle sockets, a long soak.

``burst``: ``--requests`` (default 10,000) concurrent /generate requests (900-token prompts)
hit ``launch --dp 4`` at once, ``--rounds`` (default 2) times; the router's and workers' RSS
is sampled every 0.5 s until every request has its answer (200, or 429 past
``--max-queued-requests``). The figures: RSS before, peak and after each round, the answer
counts, and that nothing was lost (every request answered). Bounded: round 2 peaks where
round 1 did.

``soak``: ``--minutes`` (default 30) of steady mixed traffic from four tenants — short chats,
long prompts with shared prefixes, streams, clients that disconnect mid-stream, a burst every
minute — against ``launch --dp 2`` (``--server-arg=--flag`` adds launcher flags); RSS of the
router and of each worker is sampled every 10 s, with the router's tree size and the workers'
cached tokens (``/metrics``). The figure: RSS after warm-up (the first 10 % of the run) vs at
the end, and the least-squares slope in MB per 10 minutes over the rest. Flat means the slope
is within noise (< 2 MB / 10 min) once the caches are full, and no request failed with a 5xx.

``sockets``: ``--sockets`` (default 20,000) connections opened by two client processes —
half idle, half slowloris (a header line every 2 s, never finishing) — against ``launch --dp 2``
with its defaults (connection cap = the file limit less 512, 10 s header timeout). While they
are held, 20 normal requests are sent one by one; the figures: how many of them succeed and
their latency, and how many of the sockets the server had closed after 5 s and 15 s.

    .venv/bin/python bench/bench_hardening.py burst [--requests 10000]
    .venv/bin/python bench/bench_hardening.py soak [--minutes 30]
    .venv/bin/python bench/bench_hardening.py sockets [--sockets 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import resource
import time
from collections import Counter

import aiohttp
import psutil
from bench_live import Server

PROMPT = "a " * 449  # 900 built-in tokens with the request number in front


def rss_mb(server: Server) -> dict[str, float]:
    """RSS in MB of the launcher/router process and of each worker child."""
    root = psutil.Process(server.proc.pid)
    out = {"router": root.memory_info().rss / 2**20}
    for i, child in enumerate(sorted(root.children(recursive=True), key=lambda p: p.pid)):
        with contextlib.suppress(psutil.NoSuchProcess):
            out[f"worker{i}"] = child.memory_info().rss / 2**20
    return out


async def bursts(server: Server, n: int, rounds: int) -> dict:
    """``rounds`` bursts back to back: bounded memory means the second peaks where the first
    did."""
    out = [await burst(server, n) for _ in range(rounds)]
    return {"rounds": out, "router_peak_mb_per_round": [r["rss_peak_mb"]["router"] for r in out]}


async def burst(server: Server, n: int) -> dict:
    samples: list[tuple[float, dict[str, float]]] = []
    before = rss_mb(server)
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def one(i: int) -> None:
            body = {"text": f"{i} {PROMPT}", "sampling_params": {"max_new_tokens": 16}}
            try:
                async with http.post(server.url + "/generate", json=body) as r:
                    await r.read()
                    statuses[r.status] += 1
            except aiohttp.ClientError as e:
                errors[type(e).__name__] += 1

        async def sample(done: asyncio.Event) -> None:
            t0 = time.perf_counter()
            while not done.is_set():
                samples.append((time.perf_counter() - t0, rss_mb(server)))
                await asyncio.sleep(0.5)

        done = asyncio.Event()
        sampler = asyncio.create_task(sample(done))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
        done.set()
        await sampler
    await asyncio.sleep(2.0)
    after = rss_mb(server)
    peak = {k: max(s.get(k, 0.0) for _, s in samples) for k in before}
    return {
        "requests": n, "wall_s": round(wall, 1),
        "statuses": dict(statuses), "client_errors": dict(errors),
        "answered": sum(statuses.values()),
        "lost": n - sum(statuses.values()) - sum(errors.values()),
        "rss_before_mb": _round(before), "rss_peak_mb": _round(peak), "rss_after_mb": _round(after),
        "router_curve_mb": [(round(t, 1), round(s["router"], 1)) for t, s in samples[::4]],
    }  # fmt: skip


async def soak(server: Server, minutes: float) -> dict:
    end = time.perf_counter() + minutes * 60
    t0 = time.perf_counter()
    samples: list[tuple[float, dict[str, float]]] = []
    statuses: Counter[int] = Counter()
    rng = random.Random(0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:

        async def call(tenant: str, body: dict, drop_after: int | None = None) -> None:
            hdr = {"X-Client-Id": tenant}
            try:
                async with http.post(server.url + "/generate", json=body, headers=hdr) as r:
                    if drop_after is None:
                        await r.read()
                    else:
                        n = 0
                        async for _ in r.content:
                            n += 1
                            if n >= drop_after:
                                break  # leaving the block closes the connection mid-stream
                    statuses[r.status] += 1
            except aiohttp.ClientError:
                statuses[-1] += 1

        async def tenant(name: str, rate: float, make) -> None:
            tasks: set[asyncio.Task] = set()
            while time.perf_counter() < end:
                task = asyncio.create_task(make(name))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)

        def chat(name: str):
            return call(
                name, {"text": f"hi {rng.random()}", "sampling_params": {"max_new_tokens": 32}}
            )

        def long_shared(name: str):
            body = {
                "text": f"{PROMPT} q{rng.randrange(10_000)}",
                "sampling_params": {"max_new_tokens": 64},
            }
            return call(name, body)

        def stream_drop(name: str):
            body = {
                "text": f"story {rng.random()}",
                "stream": True,
                "sampling_params": {"max_new_tokens": 256, "ignore_eos": True},
            }
            return call(name, body, drop_after=rng.choice([None, 3]))

        async def bursts() -> None:
            while time.perf_counter() < end:
                await asyncio.sleep(60)
                await asyncio.gather(*(chat("bursty") for _ in range(300)))

        async def sample() -> None:
            while time.perf_counter() < end:
                point = rss_mb(server)
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with http.get(server.url + "/metrics") as r:
                        point.update(_gauges(await r.text()))
                samples.append((time.perf_counter() - t0, point))
                await asyncio.sleep(10)

        await asyncio.gather(
            tenant("chat", 20, chat), tenant("rag", 4, long_shared),
            tenant("streams", 4, stream_drop), bursts(), sample(),
        )  # fmt: skip
    warm = [s for s in samples if s[0] >= 0.1 * minutes * 60] or samples
    report = {}
    curve = [
        {"t_min": round(t / 60, 1), **{k: round(v, 1) for k, v in s.items()}}
        for t, s in samples[:: max(1, len(samples) // 15)]
    ]
    for key in (k for k in samples[-1][1] if k in ("router",) or k.startswith("worker")):
        xs = [t for t, s in warm if key in s]
        ys = [s[key] for _, s in warm if key in s]
        report[key] = {
            "after_warmup_mb": round(ys[0], 1), "end_mb": round(ys[-1], 1),
            "max_mb": round(max(ys), 1), "slope_mb_per_10min": round(_slope(xs, ys) * 600, 2),
        }  # fmt: skip
    return {"minutes": minutes, "statuses": dict(statuses), "rss": report, "curve": curve}


def _gauges(text: str) -> dict[str, float]:
    """The cache sizes a flat-RSS claim depends on: the router's tree, each worker's cache."""
    out = {}
    for line in text.splitlines():
        if line.startswith("sgl_fair_router_tree_tokens "):
            out["tree_ktok"] = float(line.split()[-1]) / 1e3
        elif line.startswith("sgl_fair_worker_kv_cached_tokens{"):
            w = line.split('worker="')[1].split('"')[0]
            out[f"cached_ktok{w}"] = float(line.split()[-1]) / 1e3
    return out


def _hold_sockets(port: int, n: int, slow: bool, conn, seconds: float) -> None:
    """Child process: open ``n`` sockets (slowloris if ``slow``), report, keep them, count
    how many the server closed after 5 s and after 15 s."""
    import socket

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            break
        s.setblocking(False)
        if slow:
            s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    conn.send(len(socks))
    t0 = time.monotonic()
    closed_at: dict[float, int] = {}
    closed: set[int] = set()
    for mark in (5.0, 15.0, seconds):
        while time.monotonic() - t0 < mark:
            if slow:
                for i, s in enumerate(socks):
                    if i not in closed:
                        with contextlib.suppress(OSError):
                            s.send(b"X-a: b\r\n")
            time.sleep(2.0 if slow else 0.5)
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.recv(1, socket.MSG_PEEK)  # EOF or an error response: the server let go
                closed.add(i)
            except BlockingIOError:
                pass  # still open, nothing sent
            except OSError:
                closed.add(i)  # reset
        closed_at[mark] = len(closed)
    conn.send(closed_at)
    for s in socks:
        s.close()


def sockets(server: Server, n: int) -> dict:
    import multiprocessing as mp

    port = server.port
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for slow in (False, True):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_hold_sockets, args=(port, n // 2, slow, child, 30.0))
        p.start()
        pipes.append(parent)
        procs.append(p)
    opened = sum(pp.recv() for pp in pipes)
    lat, ok = [], 0
    body = json.dumps({"text": "still served?", "sampling_params": {"max_new_tokens": 8}})
    import httpx

    for _ in range(20):
        t0 = time.perf_counter()
        try:
            r = httpx.post(server.url + "/generate", content=body, timeout=30,
                           headers={"Content-Type": "application/json"})  # fmt: skip
            ok += r.status_code == 200
        except httpx.HTTPError:
            pass
        lat.append(time.perf_counter() - t0)
    closed = [pp.recv() for pp in pipes]
    for p in procs:
        p.join(60)
    lat.sort()
    return {
        "sockets_opened": opened, "normal_requests_ok": ok, "normal_requests": 20,
        "latency_p50_s": round(lat[len(lat) // 2], 3), "latency_max_s": round(lat[-1], 3),
        "idle_closed_by_server": closed[0], "slowloris_closed_by_server": closed[1],
    }  # fmt: skip


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _round(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in d.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("burst")
    b.add_argument("--requests", type=int, default=10_000)
    b.add_argument("--max-queued-requests", type=int, default=4096)
    b.add_argument("--rounds", type=int, default=2)
    s = sub.add_parser("soak")
    s.add_argument("--minutes", type=float, default=30.0)
    s.add_argument("--server-arg", action="append", default=[], help="a launcher flag")
    k = sub.add_parser("sockets")
    k.add_argument("--sockets", type=int, default=20_000)
    a = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client opens them all
    if a.mode == "burst":
        server = Server("--dp", "4", "--time-scale", "inf",
                        "--max-queued-requests", str(a.max_queued_requests))  # fmt: skip
        run = bursts(server, a.requests, a.rounds)
    elif a.mode == "sockets":
        server = Server("--dp", "2", "--time-scale", "inf")
        try:
            result = sockets(server, a.sockets)
        finally:
            server.stop()
        print(json.dumps(result, indent=2))
        return result
    else:
        server = Server("--dp", "2", "--schedule-policy", "vtc", *a.server_arg)
        run = soak(server, a.minutes)
    try:
        result = asyncio.run(run)
    finally:
        server.stop()
    result["mode"] = a.mode
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
