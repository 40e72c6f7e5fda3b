"""The share guard inside a real SGLang 0.5.23 server (``worker/sglang/share_preempt.py``).

``--max-running-requests 2``: the flood's two long requests hold both running slots when the
victim's short one arrives. Without preemption the victim cannot start before one of them
finishes (their 300 tokens take seconds on this CPU), whatever the queue's order. With VTC
and SGLang's priority scheduling (``--enable-priority-scheduling``, the launcher's default for
a fair policy), the plugin marks a flood request for SGLang to preempt: the victim
is served while both flood requests still run, and both still end with every token asked
(the preempted one resumes; the ledger counts it retracted, not new).
"""

from __future__ import annotations

import asyncio

import httpx
import live_rig
import pytest

from sgl_fair.worker.sglang.settings import PluginSettings

pytestmark = [pytest.mark.sglang_server, pytest.mark.slow]

ARGS = ("--max-running-requests", "2", "--chunked-prefill-size", "512")
FLOOD_TOKENS = 300
SOLO_TOKENS = 200  # the victim's request before the flood's


def _server(tiny_model, tmp_path, args):
    env = live_rig.server_env(extra=PluginSettings("vtc", {}).env())
    return live_rig.SGLangServer(tiny_model, tmp_path / "sglang-vtc.log", args=args, env=env)


async def _flood_then_victim(url, backlog=0):
    """The flood's two requests running (and ``backlog`` more of its queued behind them), then
    the victim's; the flood's running two end last in ``flood_done``."""
    async with httpx.AsyncClient() as http:
        flood = [
            asyncio.create_task(live_rig.generate(http, url, "flood", FLOOD_TOKENS, i))
            for i in (1, 2)
        ]
        await live_rig.until_loads(http, url, "num_running_reqs", 2, 60.0)
        queued = [
            asyncio.create_task(live_rig.generate(http, url, "flood", 8, 10 + i))
            for i in range(backlog)
        ]
        if backlog:
            await live_rig.until_loads(http, url, "num_waiting_reqs", backlog, 60.0)
        await asyncio.sleep(0.3)  # both decode
        victim = await live_rig.generate(http, url, "victim", 8, 0)
        flood_done = [*await asyncio.gather(*queued), *await asyncio.gather(*flood)]
        info = (await http.get(url + "/server_info", timeout=10)).json()
    return victim, flood_done, info


def _plugin_report(info):
    for state in info.get("internal_states", []):
        if "sgl_fair" in state:
            return state["sgl_fair"]
    raise AssertionError(f"no plugin report in {list(info)}")


@pytest.mark.parametrize("backlog", [0, 2], ids=["alone", "behind-a-backlog"])
def test_a_waiting_client_preempts_the_flood_holding_every_slot(tiny_model, tmp_path, backlog):
    """``behind-a-backlog``: two more flood requests wait, queued before the victim's. The
    victim, joining, is lifted to the flood's counter: a tie VTC breaks by arrival, so for a
    pass the flood's queued request is the first choice, and it cannot preempt its own client.
    The flood's running decodes are charged every step, so the victim's counter is the lower
    from the next pass on: it is the first choice, and it preempts."""
    args = (*ARGS, "--enable-priority-scheduling")
    with _server(tiny_model, tmp_path, args) as server:
        victim, flood, info = asyncio.run(_flood_then_victim(server.url, backlog))
    _, t_victim, r = victim
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 8
    for _, t, rf in flood[backlog:]:
        assert rf.status_code == 200, rf.text
        assert rf.json()["meta_info"]["completion_tokens"] == FLOOD_TOKENS  # resumed whole
        assert t_victim < t  # served while both flood requests still ran
    assert all(rf.status_code == 200 for _, _, rf in flood[:backlog])
    report = _plugin_report(info)
    assert report["share_preemptions_marked"] >= 1, report
    assert report["held"] == 0 and report["hook_errors"] == {}, report  # the ledger is empty


def test_without_priority_scheduling_the_guard_is_off(tiny_model, tmp_path):
    """The same server without SGLang's priority scheduling: the plugin has no way to
    preempt, says so (None), and the victim waits for a flood request to finish."""
    with _server(tiny_model, tmp_path, ARGS) as server:
        victim, flood, info = asyncio.run(_flood_then_victim(server.url))
    assert _plugin_report(info)["share_preemptions_marked"] is None
    assert victim[1] > min(t for _, t, _ in flood)


async def _served_more_then_flood(url, victim, flood, counts):
    """``victim`` is served a long request alone; then ``flood``'s two long requests hold
    both slots with two more queued, and ``victim`` asks again. ``counts``: the router's
    counts of calls in flight (``INFLIGHT_PARAM``) sent with the victim's and the flood's
    requests, as our bridge does. Returns (the victim's end, the running flood requests' ends)."""
    from sgl_fair.request import INFLIGHT_PARAM

    mine, theirs = ({INFLIGHT_PARAM: n} for n in counts)
    async with httpx.AsyncClient() as http:
        await live_rig.generate(http, url, victim, SOLO_TOKENS, "solo", mine)
        running = [
            asyncio.create_task(live_rig.generate(http, url, flood, FLOOD_TOKENS, i, theirs))
            for i in (1, 2)
        ]
        await live_rig.until_loads(http, url, "num_running_reqs", 2, 60.0)
        queued = [
            asyncio.create_task(live_rig.generate(http, url, flood, 8, 10 + i, theirs))
            for i in range(2)
        ]
        await live_rig.until_loads(http, url, "num_waiting_reqs", 2, 60.0)
        _, t_victim, r = await live_rig.generate(http, url, victim, 8, "again", mine)
        assert r.status_code == 200, r.text
        ends = [t for _, t, rf in await asyncio.gather(*running)]
        await asyncio.gather(*queued)
    return t_victim, ends


def test_the_routers_counts_decide_who_takes_a_slot(tiny_model, tmp_path):
    """Both slots held by the flood's long requests, two more of its requests queued ahead
    of the victim's: with 1 call in flight over the cluster to the flood's 4 (the router's
    counts, as our bridge sends them), the victim is served while both flood requests still
    run (the plugin places rule 1's newcomer ahead of the policy's choice when that choice
    cannot preempt its own client, and marks a flood request for it); with the counts the
    other way round (8 to 4) it is not owed a slot and waits for a flood request to end."""
    args = (*ARGS, "--enable-priority-scheduling")
    with _server(tiny_model, tmp_path, args) as server:
        t_light, ends_light = asyncio.run(_served_more_then_flood(server.url, "v1", "f1", (1, 4)))
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        t_heavy, ends_heavy = asyncio.run(_served_more_then_flood(server.url, "v2", "f2", (8, 4)))
        after = httpx.get(server.url + "/server_info", timeout=10).json()
    assert t_light < min(ends_light), (t_light, ends_light)
    report = _plugin_report(info)
    assert report["share_preemptions_marked"] >= 1 and report["hook_errors"] == {}, report
    assert t_heavy > min(ends_heavy), (t_heavy, ends_heavy)
    final = _plugin_report(after)
    assert final["share_preemptions_marked"] == report["share_preemptions_marked"], final
    assert final["held"] == 0 and final["hook_errors"] == {}, final
