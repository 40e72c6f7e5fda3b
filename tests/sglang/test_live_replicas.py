"""``launch --backend sglang --router-replicas 2`` over a real SGLang server on this CPU.

The launcher starts one SGLang server (our plugin inside, running VTC) and two router
replicas, each with its own bridge to it and each following its KV events. A flood sent
through replica 0 and a victim through replica 1 meet in the server's one queue, where the
plugin sees both: the victim is served ahead of the flood's backlog, as with one router.
The replicas share D2LPM's state through the plugin's service ledger, as over standalone
workers.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import live_rig
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # the launcher helpers
from live_helpers import launched_replicas, metric  # noqa: E402

pytestmark = [pytest.mark.sglang_server, pytest.mark.slow]


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory):
    args = (
        "--backend", "sglang", "--dp", "1", "--router-replicas", "2",
        "--model-path", str(tiny_model), "--schedule-policy", "vtc",
        "--heartbeat-timeout", "30", *live_rig.CPU_FLAGS,
        "--max-running-requests", "2", "--chunked-prefill-size", "512",
    )  # fmt: skip

    def ready(urls):  # replica 1's bridge reached the server too
        return httpx.get(urls[1] + "/health", timeout=2).status_code == 200

    with launched_replicas(*args, tmp_path=tmp_path_factory.mktemp("replicas-sglang"),
                           env=live_rig.server_env(cores="0"), ready=ready) as up:  # fmt: skip
        yield up


async def _generate(http, url, client, n_out, i):
    client, t, r = await live_rig.generate(http, url, client, n_out, i)
    assert r.status_code == 200, r.text
    return client, t


def test_both_replicas_serve_through_the_one_server(replicas):
    live, urls = replicas
    for url in urls:
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["workers"][0]["alive"], info["workers"]
        r = httpx.post(
            url + "/generate",
            json={"text": "Hello world! What is", "sampling_params": {"max_new_tokens": 4}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    assert "SGLang servers http://127.0.0.1:" in live.log()  # one server, both replicas over it


def test_a_victim_through_one_replica_goes_ahead_of_a_flood_through_the_other(replicas):
    _, (a, b) = replicas
    server = httpx.get(a + "/server_info", timeout=10).json()["workers"][0]["url"]

    async def main() -> list[tuple[str, float]]:
        async with httpx.AsyncClient() as http:
            flood = [asyncio.create_task(_generate(http, a, "flood", 32, i)) for i in range(24)]
            await live_rig.until_queued(http, server, 12, timeout_s=60)
            sent = time.monotonic()
            victim = [asyncio.create_task(_generate(http, b, "victim", 8, i)) for i in range(3)]
            done = await asyncio.gather(*flood, *victim)
        return sorted([("sent", sent), *done], key=lambda x: x[1])

    order = asyncio.run(main())
    sent = next(i for i, (c, _) in enumerate(order) if c == "sent")
    last = max(i for i, (c, _) in enumerate(order) if c == "victim")
    flood_between = sum(1 for c, _ in order[sent:last] if c == "flood")
    assert flood_between <= 4, order  # SGLang alone serves 10+ (test_live_plugin's baseline)


def test_the_replicas_share_their_service_through_the_servers_plugin(replicas):
    """Each replica tags its dispatches; the server's plugin keeps one row per (replica,
    client) (its ``/server_info``); each replica's bridge reads the rows and the replica takes
    the other's (issue 40, item 6). Before, replicas over SGLang servers shared nothing: plain
    routers, no rows."""
    _, (a, b) = replicas
    server = httpx.get(a + "/server_info", timeout=10).json()["workers"][0]["url"]

    async def main() -> None:
        async with httpx.AsyncClient() as http:
            sent = [_generate(http, a, "ledger-a", 6, i) for i in range(4)]
            sent += [_generate(http, b, "ledger-b", 6, i) for i in range(2)]
            await asyncio.gather(*sent)

    asyncio.run(main())
    info = httpx.get(server + "/server_info", timeout=10).json()
    service = info["internal_states"][0]["sgl_fair"]["service"]
    rows = {c: (r, e, o) for r, c, e, o, _born in service["rows"]}
    (ra, extend_a, out_a), (rb, extend_b, out_b) = rows["ledger-a"], rows["ledger-b"]
    assert ra != rb  # one row per replica
    assert (out_a, out_b) == (4 * 6, 2 * 6)  # every output token, by the replica that sent it
    assert extend_a > 0 and extend_b > 0  # each dispatch's charge (uncached prompt tokens)
    deadline = time.monotonic() + 10
    for url in (a, b):  # each replica took the other's rows from its bridge's reads
        while True:
            text = httpx.get(url + "/metrics", timeout=10).text
            if metric(text, "sgl_fair_replica_rows", worker="0") >= 1:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        assert metric(text, "sgl_fair_replica_reports_total") > 0, text
        assert metric(text, "sgl_fair_replica_reports_baseline_total") >= 1
        assert metric(text, "sgl_fair_replica_reports_refused_total") == 0
        assert 0 <= metric(text, "sgl_fair_replica_view_age_seconds", worker="0") < 2.0
