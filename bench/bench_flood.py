"""Flood isolation (issue 16, item 3): a well-behaved tenant's TTFT while another floods.

Tenant B sends ``--flood`` concurrent requests (4.8k-token prompts, 512 output tokens), once
alone and once while tenant A (same weight) sends sequential 16-token streaming requests every
``--probe-gap`` seconds for as long as the flood lasts (so A also arrives while B's decodes
hold the whole KV pool). The figures: A's TTFT P50/P99 unloaded (``--probes`` requests) and
under the flood, and B's output tokens/s alone and with A. Target: A's P99 under the flood
<= max(2x unloaded, 0.5 s), B >= 0.9x alone. ``--share-guard off`` shows the scheduler
without the share guard (worker/share_guard.py).

    .venv/bin/python bench/bench_flood.py [--dp 1] [--flood 300] [--probes 10] [--share-guard off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
from bench_live import Server

from sgl_fair.metrics import percentiles

PROMPT_B = "a " * 2399  # 4,800 built-in tokens (a word and its space are one token each)


async def ttft(http: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {"text": f"probe {i} hello", "stream": True,
            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}  # fmt: skip
    t0 = time.perf_counter()
    async with http.post(url + "/generate", json=body, headers={"X-Client-Id": "A"}) as r:
        async for _line in r.content:
            return time.perf_counter() - t0
    raise RuntimeError("no chunk")


async def flood(http: aiohttp.ClientSession, url: str, n: int, tag: str) -> tuple[int, float]:
    """B's ``n`` concurrent requests; returns (output tokens served, wall seconds)."""
    done_tokens = 0

    async def one(i: int) -> None:
        nonlocal done_tokens
        body = {"text": f"{tag}{i} {PROMPT_B}",
                "sampling_params": {"max_new_tokens": 512, "ignore_eos": True}}  # fmt: skip
        async with http.post(url + "/generate", json=body, headers={"X-Client-Id": "B"}) as r:
            out = await r.json()
            done_tokens += out["meta_info"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return done_tokens, time.perf_counter() - t0


async def run(url: str, n_flood: int, probes: int, gap_s: float) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        unloaded = [await ttft(http, url, i) for i in range(probes)]
        alone_tokens, alone_wall = await flood(http, url, n_flood, "alone")
        task = asyncio.create_task(flood(http, url, n_flood, "mixed"))
        loaded: list[float] = []
        await asyncio.sleep(gap_s)
        while not task.done():  # A probes across the whole flood, KV-full phase included
            loaded.append(await ttft(http, url, 1000 + len(loaded)))
            await asyncio.sleep(gap_s)
        mixed_tokens, mixed_wall = await task
    u, f = percentiles(unloaded), percentiles(loaded)
    alone, mixed = alone_tokens / alone_wall, mixed_tokens / mixed_wall
    return {
        "a_ttft_unloaded_p50_s": u[50], "a_ttft_unloaded_p99_s": u[99],
        "a_ttft_flood_p50_s": f[50], "a_ttft_flood_p99_s": f[99],
        "a_ttft_flood_max_s": max(loaded), "a_probes_under_flood": len(loaded),
        "b_tok_s_alone": alone, "b_tok_s_with_a": mixed, "b_ratio": mixed / alone,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--flood", type=int, default=300)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--probe-gap", type=float, default=1.0, help="seconds between A's probes")
    ap.add_argument("--policy", default="vtc")
    ap.add_argument("--share-guard", choices=("auto", "on", "off"), default="auto")
    a = ap.parse_args(argv)
    server = Server("--dp", str(a.dp), "--schedule-policy", a.policy, "--router-policy",
                    "d2lpm", "--sim-eos", "off", "--share-guard", a.share_guard)  # fmt: skip
    try:
        result = asyncio.run(run(server.url, a.flood, a.probes, a.probe_gap))
    finally:
        server.stop()
    result.update(dp=a.dp, flood=a.flood, policy=a.policy, share_guard=a.share_guard)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
