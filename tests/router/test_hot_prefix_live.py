"""Issue 15: one tenant, one hot prefix, 3,000 requests on 4 workers — live. The router-level
test (``test_d2lpm.test_one_hot_prefix_does_not_pile_onto_one_worker``) drives ``Router``
directly; here the same burst goes over HTTP through ``launch --dp 4`` with the default D2LPM
router, and the router's own per-worker queue gauge is read while the burst is queued (the
simulated GPUs run 50× slower than real time, so almost nothing finishes meanwhile)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from live_helpers import launched, metric

N = 3000
PREFIX = list(range(1000, 1500))  # 500 shared tokens
SP = {"max_new_tokens": 64, "ignore_eos": True}


@pytest.mark.slow
def test_live_hot_prefix_burst_is_spread_over_the_workers(tmp_path):
    args = ("--dp", "4", "--time-scale", "0.02", "--max-running-requests", "8")
    with launched(*args, tmp_path=tmp_path) as live:
        queues = asyncio.run(_burst(live.url))
    mean = sum(queues) / len(queues)
    assert sum(queues) >= 0.9 * N, queues  # the burst is queued, not yet served
    assert max(queues) <= 2 * mean, queues  # the paper's rule puts ~all of it on one worker


async def _burst(url: str) -> list[float]:
    limits = httpx.Limits(max_connections=N + 8)  # every request in flight at once
    async with (
        httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http,
        httpx.AsyncClient(base_url=url, timeout=10) as probe,
    ):

        async def one(i: int) -> None:
            body = {"input_ids": [*PREFIX, 10_000 + i], "sampling_params": SP, "rid": f"h{i}"}
            await http.post("/generate", json=body, headers={"X-Client-Id": "acme"})

        tasks = [asyncio.ensure_future(one(i)) for i in range(N)]
        queues: list[float] = []
        for _ in range(450):  # until the router has dispatched the whole burst (<= 45 s)
            await asyncio.sleep(0.1)
            text = (await probe.get("/metrics")).text
            queues = [metric(text, "sgl_fair_worker_queue_length", worker=str(u)) for u in range(4)]
            if sum(queues) >= 0.9 * N:
                break
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return queues
