"""BROS over bidirectional KV blocks in the live server: RT and BE requests over HTTP on a
pool small enough that RT growth checkpoints BE slots (and with ``--kv-allocator-opt``, on a
host too small to hold them all); every request completes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from live_helpers import launched

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("policy", "opts"),
    [
        ("bros", ()),
        ("vtc", ()),
        # A host too small for every overwritten BE slot: RT then waits for BE to finish.
        ("bros", ("--kv-allocator-opt", "block_size=8",
                  "--kv-allocator-opt", "host_capacity_tokens=64")),
    ],
)  # fmt: skip
def test_rt_and_be_over_http_on_bidirectional_blocks(tmp_path, policy, opts):
    args = ("--dp", "1", "--time-scale", "inf", "--schedule-policy", policy,
            "--kv-allocator", "bidirectional", "--kv-tokens", "3000", *opts)  # fmt: skip
    with launched(*args, tmp_path=tmp_path) as s:

        async def one(client: httpx.AsyncClient, i: int, cls: str) -> int:
            words = 300 if cls == "be" else 40
            body = {"text": f"{cls} {i} " + "w " * words, "priority_class": cls,
                    "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}  # fmt: skip
            r = await client.post(s.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["meta_info"]["priority_class"] == cls
            return out["meta_info"]["completion_tokens"]

        async def main() -> list[int]:
            async with httpx.AsyncClient() as client:
                jobs = [one(client, i, "be") for i in range(8)]
                jobs += [one(client, i, "rt") for i in range(12)]
                return await asyncio.gather(*jobs)

        assert asyncio.run(main()) == [24] * 20
