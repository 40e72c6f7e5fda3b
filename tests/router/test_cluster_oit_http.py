"""FairServe's OIT at the router, live (``--dp 2``, simulated workers): an abusive user whose
new interactions are spread over both workers gets 429 + Retry-After from the router (each
worker's own limit is set far above what it sees), while a benign user's multi-call
interaction, and the abusive user's interaction already in flight, complete."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from live_helpers import launched, metric

CLUSTER_OIT = (
    "--dp", "2", "--router-policy", "rr", "--schedule-policy", "fairserve",
    # the workers: overloaded as soon as anything waits, but a limit no worker reaches here
    "--schedule-policy-opt", "max_waiting=0", "--schedule-policy-opt", "limits.user_limit=100",
    # the router: max_waiting=0 is carried over; its own user limit
    "--cluster-oit-opt", "limits.user_limit=4", "--cluster-oit-opt", "limits.window_s=60",
    "--max-running-requests", "2", "--time-scale", "1",
)  # fmt: skip
SP = {"max_new_tokens": 96, "ignore_eos": True}
MSG = [{"role": "user", "content": "hi"}]
THROTTLE = {"limit": "user", "max_requests": 4, "window_s": 60.0}


@pytest.mark.slow
def test_live_router_throttles_an_abusive_user_over_the_cluster(tmp_path):
    with launched(*CLUSTER_OIT, tmp_path=tmp_path) as live:
        info = live.info()
        assert info["cluster_oit"] is True
        assert info["cluster_oit_opts"] == {
            "max_waiting": 0, "limits": {"user_limit": 4, "window_s": 60},
        }  # fmt: skip
        asyncio.run(_scenario(live.url))
        text = httpx.get(live.url + "/metrics", timeout=10).text
        name = "sgl_fair_requests_throttled_total"
        assert metric(text, name, tenant="mallory", limit="user", where="router") >= 3
        assert metric(text, name, where="worker") == 0  # the workers alone let them in
        assert metric(text, name, tenant="alice") == 0


async def _scenario(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def gen(who: str, **body) -> httpx.Response:
            payload = {"text": f"{who} asks", "sampling_params": SP, **body}
            return await http.post("/generate", json=payload, headers={"X-Client-Id": who})

        async def alice() -> list[httpx.Response]:
            return [
                await gen("alice", interaction_id="tot-1", app="tot", stage=i) for i in range(3)
            ]

        alice_task = asyncio.ensure_future(alice())
        m1 = asyncio.ensure_future(gen("mallory", interaction_id="m-1", app="spam", stage=0))
        await asyncio.sleep(0.3)  # one call running on each worker; nothing waits yet
        # 8 new interactions, spread over both workers by round robin: now requests wait
        flood = [
            asyncio.ensure_future(gen("mallory", interaction_id=f"f-{i}", app="spam"))
            for i in range(8)
        ]
        await asyncio.sleep(0.4)  # the workers' Load reports say so (every 0.1 s)
        refused = []
        for i in range(3):  # more new interactions: over 4 per 60 s across the cluster
            refused.append(await gen("mallory", interaction_id=f"g-{i}", app="spam"))
        payload = {"text": "again", "sampling_params": SP, "stream": True, "app": "spam"}
        async with http.stream(
            "POST", "/generate", json=payload, headers={"X-Client-Id": "mallory"}
        ) as r:
            body = await r.aread()
            assert r.status_code == 429, body  # the status, not a 200 stream with an error
            assert "Retry-After" in r.headers
            assert json.loads(body)["error"]["throttle"] == THROTTLE
        chat = {"model": "m", "messages": MSG, "max_tokens": 8, "user": "mallory", "app": "spam"}
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 429 and "Retry-After" in r.headers, r.text
        assert r.json()["error"]["throttle"] == THROTTLE
        for r in refused:
            assert r.status_code == 429, r.text
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == 429
            assert err["throttle"] == THROTTLE
            assert "over its limit of 4 requests per 60 s" in err["message"]

        # a call continuing mallory's interaction in flight is never throttled
        m1_next = await gen("mallory", interaction_id="m-1", app="spam", stage=1)
        assert m1_next.status_code == 200, m1_next.text
        assert (await m1).status_code == 200
        assert all(r.status_code in (200, 429) for r in await asyncio.gather(*flood))
        # the benign user's interaction completes, every call 200
        for r in await alice_task:
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) == SP["max_new_tokens"]
