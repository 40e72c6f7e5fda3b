"""BROS in the live server on its default KV allocator (token): an RT request that finds the
pool held by BE work takes BE requests' KV (they are retracted and recompute), so it is
served before the BE job ends; with ``preempt_be=false`` it waits for a BE request to finish.
Every request, retracted ones included, still returns exactly its tokens over HTTP."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from live_helpers import launched, metric

pytestmark = pytest.mark.slow

BE_PROMPT, BE_OUT, RT_PROMPT, RT_OUT = 850, 120, 900, 8


def ids(i: int, n: int) -> list[int]:
    rng = random.Random(f"ids/{i}")  # a string: an int seed loses its sign (-1 is 1)
    return [rng.randrange(1_000, 30_000) for _ in range(n)]


async def run(url: str) -> tuple[float, list[float], list[int]]:
    """BE requests fill the pool and stream; once they are decoding, one RT request comes.
    Returns when the RT request finished, when each BE request did, and every count."""
    t0 = time.monotonic()
    decoding = asyncio.Event()
    started = 0
    be_done: list[float] = []
    counts: list[int] = []

    async def be(client: httpx.AsyncClient, i: int) -> None:
        nonlocal started
        body = {"input_ids": ids(i, BE_PROMPT), "stream": True, "priority_class": "be",
                "sampling_params": {"max_new_tokens": BE_OUT, "ignore_eos": True}}  # fmt: skip
        first = True
        async with client.stream("POST", url + "/generate", json=body, timeout=120) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if first and line.startswith("data: {"):
                    first = False
                    started += 1
                    if started == 3:
                        decoding.set()
                if '"finish_reason": {' in line or '"finish_reason":{' in line:
                    counts.append(int(line.split('"completion_tokens":')[1].split(",")[0]))
        be_done.append(time.monotonic() - t0)

    async def rt(client: httpx.AsyncClient) -> float:
        await decoding.wait()
        body = {"input_ids": ids(-1, RT_PROMPT), "priority_class": "rt",
                "sampling_params": {"max_new_tokens": RT_OUT, "ignore_eos": True}}  # fmt: skip
        r = await client.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        counts.append(r.json()["meta_info"]["completion_tokens"])
        return time.monotonic() - t0

    async with httpx.AsyncClient() as client:
        jobs = [be(client, i) for i in range(3)]
        rt_done, *_ = await asyncio.gather(rt(client), *jobs)
    return rt_done, be_done, counts


@pytest.mark.parametrize("preempt", [True, False])
def test_an_rt_request_takes_be_kv_in_the_live_server(tmp_path, preempt: bool) -> None:
    args = ("--dp", "1", "--time-scale", "0.5", "--schedule-policy", "bros",
            "--kv-tokens", "3000", "--max-running-requests", "8")  # fmt: skip
    if not preempt:
        args = (*args, "--schedule-policy-opt", "preempt_be=false")
    with launched(*args, tmp_path=tmp_path) as live:
        rt_done, be_done, counts = asyncio.run(run(live.url))
        time.sleep(0.5)  # a Load report after the last step
        text = httpx.get(live.url + "/metrics", timeout=10).text
        retractions = metric(text, "sgl_fair_worker_retractions")
        assert live.info()["workers"][0]["num_retractions"] == retractions
    assert sorted(counts) == [RT_OUT] + [BE_OUT] * 3  # retracted requests finish in full
    if preempt:
        assert rt_done < min(be_done), (rt_done, be_done)  # served while BE still runs
        assert retractions >= 1
    else:
        assert rt_done > min(be_done), (rt_done, be_done)  # waited for a BE request
        assert retractions == 0
