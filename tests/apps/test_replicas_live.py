"""Router replicas, live on loopback: ``launch --dp 2 --router-replicas 2`` (real processes,
real HTTP), issue 34's live tests.

* a flood through replica 0 and a victim through replica 1: the victim is served ahead of
  the flood's queue (the workers' fair policy sees both replicas' requests);
* a worker added at run time (``POST /workers``) takes requests, then drains
  (``DELETE /workers/{id}``): no new requests, the ones on it finish, then it is gone;
* ``kill -9`` of one replica under load: the other serves on; every non-streaming request
  the dead one lost is retried on the other (what a load balancer does) and completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from remote_helpers import free_port_pair, free_port_run, start_worker, stop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[tuple[list[str], list[int], subprocess.Popen]]:
    port = free_port_run(2)
    log_path = tmp_path_factory.mktemp("replicas") / "launch.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--dp", "2", "--router-replicas", "2",
           "--port", str(port), "--schedule-policy", "vtc", "--gpu", "A10G",
           "--model", "Llama-2-7B", "--kv-tokens", "6000", "--max-running-requests", "8",
           "--sim-eos", "off", "--worker-restart-backoff", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 90
    pids: list[int] = []
    while not pids:
        assert proc.poll() is None, log_path.read_text()
        assert time.time() < deadline, log_path.read_text()
        m = re.search(r"replicas ready at .*\(pids ([\d, ]+);", log_path.read_text())
        if m:
            pids = [int(x) for x in m.group(1).split(",")]
        time.sleep(0.2)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    try:
        yield urls, pids, proc
    finally:
        stop(proc)
        log.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def body(n_in: int, n_out: int, seed: int) -> dict:
    ids = [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n_in)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True}}


async def timed(client: httpx.AsyncClient, url: str, who: str, b: dict) -> float:
    t0 = time.monotonic()
    r = await client.post(url + "/generate", json=b, headers={"X-Client-Id": who})
    r.raise_for_status()
    return time.monotonic() - t0


def test_a_victim_through_one_replica_is_served_ahead_of_a_flood_through_the_other(replicas):
    (a, b), _pids, _proc = replicas

    async def main() -> tuple[list[float], list[float]]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            flood = [
                asyncio.create_task(timed(client, a, "flood", body(256, 48, i))) for i in range(48)
            ]
            await asyncio.sleep(1.0)  # the flood fills both workers' queues
            victim = await asyncio.gather(
                *(timed(client, b, "victim", body(256, 4, 1000 + i)) for i in range(2))
            )
            return list(victim), list(await asyncio.gather(*flood))

    victim, flood = asyncio.run(main())
    flood.sort()
    median = flood[len(flood) // 2]
    # behind the flood's queue (FCFS) the victim would wait for its third wave (~ the flood's
    # last); the fair workers admit it in the first free slot
    assert max(victim) < 0.6 * median, (victim, median)
    # the replica layer on /metrics: each holds the other's rows, fresh, none refused
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "router"))
    from live_helpers import metric

    for url in (a, b):
        text = httpx.get(url + "/metrics", timeout=10).text
        assert metric(text, "sgl_fair_replica_reports_total") > 0, text
        assert metric(text, "sgl_fair_replica_reports_baseline_total") >= 2  # one per worker
        assert metric(text, "sgl_fair_replica_reports_refused_total") == 0
        assert metric(text, "sgl_fair_replica_rows") >= 1  # the other replica's client
        for w in ("0", "1"):
            assert 0 <= metric(text, "sgl_fair_replica_view_age_seconds", worker=w) < 2.0


def test_a_worker_added_and_drained_at_run_time(replicas):
    (a, b), _pids, _proc = replicas
    port = free_port_pair()
    extra = start_worker(port, "--time-scale", "1", "--sim-eos", "off", "--gpu", "A10G",
                         "--model", "Llama-2-7B")  # fmt: skip
    try:
        r = httpx.post(b + "/workers", json={"endpoint": f"tcp://127.0.0.1:{port}"}, timeout=10)
        assert r.status_code == 201, r.text
        wid = r.json()["id"]
        bad = httpx.post(b + "/workers", json={"endpoint": "127.0.0.1:1"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "endpoint"
        deadline = time.time() + 10
        while time.time() < deadline:
            rows = httpx.get(b + "/workers", timeout=10).json()["workers"]
            if next(w for w in rows if w["id"] == wid)["state"] == "ready":
                break
            time.sleep(0.1)
        else:
            raise AssertionError(rows)

        async def load(n: int) -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(
                    client.post(b + "/generate", json=body(64, 64, 3000 + i),
                                headers={"X-Client-Id": f"c{i % 3}"})
                    for i in range(n)
                ))  # fmt: skip

        async def drain_under_load() -> tuple[list[httpx.Response], dict]:
            task = asyncio.create_task(load(12))
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(timeout=10) as client:
                rows = (await client.get(b + "/workers")).json()["workers"]
                on_new = next(w for w in rows if w["id"] == wid)["in_flight"]
                d = await client.delete(f"{b}/workers/{wid}")
            return await task, {"on_new": on_new, "delete": d}

        answers, seen = asyncio.run(drain_under_load())
        assert seen["on_new"] > 0  # the added worker took requests
        assert seen["delete"].status_code in (200, 202), seen["delete"].text
        assert all(x.status_code == 200 for x in answers)  # its own finished
        deadline = time.time() + 15
        while time.time() < deadline:
            rows = httpx.get(b + "/workers", timeout=10).json()["workers"]
            if all(w["id"] != wid for w in rows):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(rows)
        info = httpx.get(b + "/server_info", timeout=10).json()
        assert all(w["id"] != wid for w in info["workers"])
    finally:
        extra.kill()
        extra.wait(5)


def test_kill_9_one_replica_under_load_the_other_serves_on(replicas):
    (a, b), pids, _proc = replicas

    async def main() -> tuple[int, int, int]:
        retried = failed = ok = 0
        async with httpx.AsyncClient(timeout=60) as client:

            async def one(i: int) -> None:
                nonlocal retried, failed, ok
                url = (a, b)[i % 2]
                try:
                    r = await client.post(url + "/generate", json=body(64, 32, 5000 + i))
                    r.raise_for_status()
                except httpx.HTTPError:
                    retried += 1  # the load balancer retries on the other replica
                    try:
                        r = await client.post(b + "/generate", json=body(64, 32, 5000 + i))
                        r.raise_for_status()
                    except httpx.HTTPError:
                        failed += 1
                        return
                ok += 1

            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            await asyncio.sleep(0.5)
            os.kill(pids[0], signal.SIGKILL)
            await asyncio.gather(*tasks)
        return ok, retried, failed

    ok, retried, failed = asyncio.run(main())
    assert failed == 0 and ok == 40
    assert retried > 0  # the dead replica did hold some
    assert httpx.get(b + "/health", timeout=10).status_code == 200
