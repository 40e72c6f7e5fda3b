"""Tensor-parallel ranks decide alike: every rank's plugin reads one clock, the tick the
pulling rank adds to the requests SGLang broadcasts to its TP ranks (worker/sglang/clock.py),
never its own process clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq
from sglang_rig import Rig, make_req

from sgl_fair.policies import make_policy
from sgl_fair.worker.sglang.adapter import FairSchedulePolicy
from sgl_fair.worker.sglang.clock import RANK_CLOCK, RankClock, Tick

pytestmark = pytest.mark.usefixtures("plugin_hooks")


def _readings(*values):
    """A process clock that reads ``values`` in turn (then the last one)."""
    it = iter(values)
    last = [values[0]]

    def read() -> float:
        last[0] = next(it, last[0])
        return last[0]

    return read


def _run_ranks(clocks, tick_from=None, pipeline=False) -> list[list[str]]:
    """The same two scheduler iterations on one adapter per rank: ``rpm`` at 1 request per
    second per client; iteration 2's request comes 0.997 s after iteration 1's on rank 0,
    and rank 1 reads its own clock 5 ms later then. ``tick_from``: the rank whose clock
    ticks every rank (as the broadcast carries it); None: each rank reads its own."""
    admitted: list[list[str]] = []
    adapters = []
    for clock in clocks:
        rig = Rig()
        policy = make_policy("rpm", limit=1, window_s=1.0)
        adapters.append((rig, FairSchedulePolicy(policy, rig.tree, clock=clock, shadow=False)))
    try:
        for step in range(2):
            if pipeline:  # stage 0 pulls and ticks; each stage relays to the next
                pulled = []
                clocks[0].stamp(pulled)
                assert clocks[0].take(pulled) == []
                for before, after in zip(clocks, clocks[1:], strict=False):
                    relayed: list = ["req"]  # what the stage ingested, sent on
                    before.relay(relayed)
                    assert after.take(relayed) == ["req"]
            elif tick_from is not None:
                pulled: list = []
                clocks[tick_from].stamp(pulled)  # the pulling rank
                for clock in clocks:  # SGLang's broadcast: the same list on every rank
                    assert clock.take(list(pulled)) == []
            for rig, fair in adapters:
                rig.scheduler.policy = fair
                req = make_req([1, 2, 3, step], "alice", rid=f"step-{step}")
                if fair.ledger.arrived(req) is None:
                    rig.queue(req)
            admitted.append(
                [",".join(r.rid for r in rig.admit()) for rig, _ in adapters]
            )  # fmt: skip
    finally:
        for _rig, fair in adapters:
            fair.detach()
    return [list(x) for x in zip(*admitted, strict=True)]  # per rank


def test_two_ranks_with_clocks_a_few_ms_apart_admit_identically():
    rank0 = RankClock(_readings(100.000, 100.997))
    rank1 = RankClock(_readings(100.000, 101.002))  # the same moments, read 0-5 ms later
    # Each on its own process clock (what the plugin did): rank 1 admits what rank 0 refuses.
    own = _run_ranks([_readings(100.000, 100.997), _readings(100.000, 101.002)])
    assert own == [["step-0", ""], ["step-0", "step-1"]]  # the scenario discriminates
    # On the broadcast tick: identical decisions (rank 0's reading, on both).
    ticked = _run_ranks([rank0, rank1], tick_from=0)
    assert ticked == [["step-0", ""], ["step-0", ""]]
    assert rank0() == rank1() == 100.997


def test_the_plugin_ticks_through_sglangs_own_receiver(monkeypatch):
    """SGLang's real ``_pull_raw_reqs`` (hooked) adds the tick on the pulling rank; its real
    ``_broadcast_reqs_across_ranks`` (hooked) hands every rank the list without it, and the
    plugin's clock reads it. Nothing pulled, it ticks only for a policy whose order reads the
    clock (``orders_by_time``): else the broadcast stays an empty list, one collective, not two
    on every scheduler iteration."""
    from sglang.srt.managers.scheduler_components.request_receiver import (
        SchedulerRequestReceiver as Receiver,
    )

    from sgl_fair.worker.sglang import plugin
    from sgl_fair.worker.sglang.settings import PluginSettings

    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PULL) for _ in range(2)]
    try:
        fake = SimpleNamespace(
            recv_from_tokenizer=socks[0],
            recv_from_rpc=socks[1],
            recv_limit_reached=lambda n: False,
        )
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0):
            monkeypatch.setattr(plugin, "_ticks_every_pass", False)  # dlpm, vtc, fcfs, ...
            assert Receiver._pull_raw_reqs(fake) == []  # nothing pulled: nothing added
            pulled_req = object()
            assert [type(x) for x in plugin._after_pull([pulled_req], fake)] == [object, Tick]
            monkeypatch.setattr(plugin, "_ticks_every_pass", True)  # bros, fairserve
            pulled = Receiver._pull_raw_reqs(fake)  # rank 0 of one TP rank: no broadcast
            assert [type(x) for x in pulled] == [Tick]
            req = object()
            out = Receiver._broadcast_reqs_across_ranks(fake, [req, *pulled], None)
        assert out == [req] and RANK_CLOCK() == pulled[0].t
        rig = Rig()
        fair = plugin.install_policy(rig.scheduler, PluginSettings("vtc", {}))
        try:
            assert fair.ledger.clock is RANK_CLOCK
        finally:
            fair.detach()
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def test_pipeline_stages_decide_by_stage_0s_tick():
    """PP stages plan the same batches: stage 1 takes stage 0's tick from what stage 0
    relays (``RankClock.relay``), never its own clock 5 ms later (issue 39: every stage
    stamped its own)."""
    own = _run_ranks([_readings(100.000, 100.997), _readings(100.000, 101.002)])
    assert own[0] != own[1]  # on their own clocks the stages diverge
    stage0 = RankClock(_readings(100.000, 100.997))
    stage1 = RankClock(_readings(100.000, 101.002))
    assert _run_ranks([stage0, stage1], pipeline=True) == [["step-0", ""], ["step-0", ""]]
    assert stage0() == stage1() == 100.997
    unchanged: list = []
    stage0.relay(unchanged)  # the same tick again: nothing to send
    assert unchanged == []


def test_the_plugin_relays_the_tick_down_the_pipeline(monkeypatch):
    """Through the plugin's hooks: stage 0's ingested list gains its tick for stage 1;
    stage 1 (which "pulls" that list from stage 0) does not stamp its own, and takes stage
    0's at SGLang's real broadcast; the last stage relays nothing."""
    from sglang.srt.managers.scheduler_components.request_receiver import (
        SchedulerRequestReceiver as Receiver,
    )
    from sglang.srt.runtime_context import get_parallel

    from sgl_fair.worker.sglang import plugin

    monkeypatch.setattr(plugin, "_ticks_every_pass", True)
    monkeypatch.setattr(RANK_CLOCK, "t", 50.0)
    monkeypatch.setattr(RANK_CLOCK, "_relayed", None)
    req = object()
    with get_parallel().override(pp_rank=0, pp_size=2):
        sent = plugin._after_ingest([req], None)
    assert sent[0] is req and [type(x) for x in sent] == [object, Tick] and sent[1].t == 50.0
    monkeypatch.setattr(RANK_CLOCK, "t", 49.0)  # stage 1's own reading: must not count
    with get_parallel().override(pp_rank=1, pp_size=2, attn_tp_rank=0, attn_cp_rank=0):
        pulled = plugin._after_pull(list(sent), None)
        assert [type(x) for x in pulled] == [object, Tick]  # no second, local tick
        out = Receiver._broadcast_reqs_across_ranks(SimpleNamespace(), pulled, None)
        assert out == [req] and RANK_CLOCK() == 50.0
        last = plugin._after_ingest([req], None)
    assert last == [req]  # the last stage sends nothing on
