"""Flood isolation (issue 16, item 3): a well-behaved tenant's TTFT while another floods.

Tenant B sends ``--flood`` concurrent requests (4.8k-token prompts, 512 output tokens);
tenant A (same weight) then sends ``--probes`` sequential 16-token streaming requests. The
figure is A's TTFT P50/P99 unloaded and under the flood, and B's output tokens/s under the
flood. Target: A's P99 under the flood <= max(2x unloaded, 0.5 s), B >= 0.9x alone.

    .venv/bin/python bench/bench_flood.py [--dp 1] [--flood 300] [--probes 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
from bench_live import Server

from sgl_fair.metrics import percentiles

PROMPT_B = " ".join(f"flood{i % 97}" for i in range(2400))  # ~4.8k built-in tokens


async def ttft(http: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {"text": f"probe {i} hello", "stream": True,
            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}  # fmt: skip
    t0 = time.perf_counter()
    async with http.post(url + "/generate", json=body, headers={"X-Client-Id": "A"}) as r:
        async for _line in r.content:
            return time.perf_counter() - t0
    raise RuntimeError("no chunk")


async def run(url: str, flood: int, probes: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        unloaded = [await ttft(http, url, i) for i in range(probes)]
        done_tokens = 0

        async def one(i: int) -> None:
            nonlocal done_tokens
            body = {"text": f"{i} {PROMPT_B}",
                    "sampling_params": {"max_new_tokens": 512, "ignore_eos": True}}  # fmt: skip
            async with http.post(url + "/generate", json=body,
                                 headers={"X-Client-Id": "B"}) as r:  # fmt: skip
                out = await r.json()
                done_tokens += out["meta_info"]["completion_tokens"]

        t0 = time.perf_counter()
        flood_tasks = [asyncio.create_task(one(i)) for i in range(flood)]
        await asyncio.sleep(2.0)  # B's requests fill the running batch and the KV pool
        loaded = [await ttft(http, url, 100 + i) for i in range(probes)]
        t_probe = time.perf_counter() - t0
        await asyncio.gather(*flood_tasks)
        wall = time.perf_counter() - t0
    u, f = percentiles(unloaded), percentiles(loaded)
    return {
        "a_ttft_unloaded_p50_s": u[50], "a_ttft_unloaded_p99_s": u[99],
        "a_ttft_flood_p50_s": f[50], "a_ttft_flood_p99_s": f[99],
        "b_tok_s": done_tokens / wall, "probe_window_s": t_probe,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--flood", type=int, default=300)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--policy", default="vtc")
    a = ap.parse_args(argv)
    server = Server("--dp", str(a.dp), "--schedule-policy", a.policy, "--router-policy",
                    "d2lpm", "--sim-eos", "off")  # fmt: skip
    try:
        result = asyncio.run(run(server.url, a.flood, a.probes))
    finally:
        server.stop()
    result.update(dp=a.dp, flood=a.flood, policy=a.policy)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
