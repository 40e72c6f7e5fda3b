"""A burst of thousands of concurrent requests: the server answers each (200 or 429), its
event loop never stalls long, and no worker is declared dead.

The hardening issue's measurement: 8,000 concurrent requests of 900-token prompts stalled
the router's loop 12–21 s; the watchdog then declared all four workers dead for good and
every later request got 503. A smaller burst of the same shape runs here (2 cores).
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest
from live_helpers import launched, metric

pytestmark = pytest.mark.slow

NUM = 1500
ARGS = ("--dp", "2", "--time-scale", "inf", "--heartbeat-timeout", "2")


async def burst(url: str) -> list[int]:
    prompt = " ".join(f"word{i % 50}" for i in range(450))  # ~900 tokens, built-in tokenizer
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def one(i: int) -> int:
            body = {"text": f"{i} {prompt}", "sampling_params": {"max_new_tokens": 4}}
            try:
                async with http.post(url + "/generate", json=body) as r:
                    await r.read()
                    return r.status
            except aiohttp.ClientError:
                return -1  # a dropped connection: a lost request

        return await asyncio.gather(*(one(i) for i in range(NUM)))


def test_a_burst_is_answered_and_kills_no_worker(tmp_path):
    args = (*ARGS, "--max-queued-requests", "1000")
    with launched(*args, tmp_path=tmp_path) as s:
        statuses = asyncio.run(burst(s.url))
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        assert statuses.count(200) >= 1000 // 2  # most of what fits is served
        info = s.info()
        for w in info["workers"]:
            assert w["alive"] and w["death"] is None and w["revived"] == 0, w
        text = httpx.get(s.url + "/metrics", timeout=10).text
        lag = metric(text, "sgl_fair_router_loop_lag_max_seconds")
        print(f"max loop lag {lag:.3f}s, {statuses.count(429)} refused")
        assert lag < 0.7, lag  # without the gate: 1.4 s here (the whole burst in one pass)
        assert metric(text, "sgl_fair_requests_refused_queue_full_total") == statuses.count(429)
        r = httpx.post(s.url + "/generate", json={"text": "after"}, timeout=30)
        assert r.status_code == 200
