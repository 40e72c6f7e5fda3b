"""Aborts in the scheduler and the WorkerCore that the simulator and live workers share."""

from __future__ import annotations

import random

import pytest
from conftest import FixedEngine, assert_kv_conserved, make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.messages import Finished, FinishReason, Load, Tokens
from sgl_fair.policies import policy_names
from sgl_fair.request import Phase, Request
from sgl_fair.worker.service import WorkerCore
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine


def _req(rid: str, client: str = "a", n_in: int = 8, n_out: int = 4, t: float = 0.0) -> Request:
    rng = random.Random(rid)
    ids = tuple(rng.randrange(1000) for _ in range(n_in))
    return Request(rid, client, ids, n_out, t)


def _run_step(sched, engine, now):
    batch = sched.step(now)
    if batch is None:
        return False
    sched.apply(engine.run(batch), now)
    return True


@pytest.mark.parametrize("policy", policy_names())
def test_abort_a_waiting_request_frees_its_queue_slot(policy: str) -> None:
    sched = make_scheduler(policy, capacity=64, max_running_requests=1)
    engine = FixedEngine()
    a, b = _req("a", "x"), _req("b", "y")
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    _run_step(sched, engine, 0.0)  # one admitted, the other waits (one running slot)
    waiting = sched.waiting[0]
    assert sched.abort(waiting, 0.1, "gone")
    assert waiting.phase is Phase.ABORTED and waiting.abort_reason == "gone"
    assert waiting not in sched.waiting and sched.log.done[-1] is waiting
    assert not sched.policy.active.is_active(waiting.client)  # it left the queue
    assert not sched.abort(waiting, 0.2)  # idempotent
    while _run_step(sched, engine, 0.3):
        pass
    assert_kv_conserved(sched)
    assert sched.kv.usage().locked == 0 and sched.kv.usage().private == 0


def test_abort_a_running_request_keeps_its_kv_cached_and_frees_the_rest() -> None:
    sched = make_scheduler("fcfs", capacity=200)
    engine = FixedEngine()
    r = _req("r", n_in=20, n_out=50)
    sched.add_request(r, 0.0)
    for _ in range(5):
        _run_step(sched, engine, 0.0)
    assert r.phase is Phase.RUNNING and r.num_output == 5
    assert sched.abort(r, 1.0)
    assert r.phase is Phase.ABORTED and r not in sched.running
    usage = assert_kv_conserved(sched)
    assert usage.locked == 0 and usage.private == 0
    # What it computed (prompt + outputs but the last) is in the prefix cache.
    assert sched.kv.match_len(r.all_ids()) == r.num_computed == 20 + 5 - 1
    assert not sched.has_work()


def test_abort_mid_chunked_prefill() -> None:
    sched = make_scheduler("fcfs", capacity=500, chunked_prefill_size=16)
    engine = FixedEngine()
    r = _req("r", n_in=100)
    sched.add_request(r, 0.0)
    _run_step(sched, engine, 0.0)
    assert sched.chunked is r
    assert sched.abort(r, 0.1)
    assert sched.chunked is None and r.phase is Phase.ABORTED
    usage = assert_kv_conserved(sched)
    assert usage.locked == usage.private == 0
    assert sched.kv.match_len(r.input_ids) == 16


def test_abort_between_step_and_apply_is_refused() -> None:
    sched = make_scheduler("fcfs", capacity=200)
    r = _req("r")
    sched.add_request(r, 0.0)
    sched.step(0.0)
    with pytest.raises(RuntimeError):
        sched.abort(r, 0.0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_random_aborts_conserve_kv_and_everyone_leaves(data) -> None:
    policy = data.draw(st.sampled_from(["fcfs", "lpm", "vtc", "dlpm"]))
    sched = make_scheduler(policy, capacity=300, chunked_prefill_size=32)
    engine = FixedEngine()
    reqs = [
        _req(f"r{i}", f"c{i % 3}", data.draw(st.integers(1, 60)), data.draw(st.integers(1, 20)))
        for i in range(data.draw(st.integers(1, 12)))
    ]
    for r in reqs:
        sched.add_request(r, 0.0)
    t = 0.0
    for _ in range(400):
        if data.draw(st.booleans()):
            victim = data.draw(st.sampled_from(reqs))
            sched.abort(victim, t)
        if not _run_step(sched, engine, t):
            break
        t += 0.01
        sched.check_invariants()
    assert not sched.has_work()
    assert {r.phase for r in reqs} <= {Phase.FINISHED, Phase.ABORTED}
    assert len(sched.log.done) == len(reqs)
    usage = assert_kv_conserved(sched)
    assert usage.locked == usage.private == 0


def _core(**kw) -> WorkerCore:
    sched = make_scheduler("vtc", capacity=400)
    engine = SimEngine(CostModel.from_names("A100-80GB", "Llama-3.1-8B"), token_range=(259, 32000))
    return WorkerCore(3, sched, engine, **kw)


def _drive(core: WorkerCore, t: float = 0.0) -> list:
    out = []
    while True:
        result = core.step(t)
        if result is None:
            break
        t += result.duration_s
        core.complete(result, t)
        out += core.drain(t).messages
    return out


def test_worker_core_reports_tokens_then_finished_with_logprobs() -> None:
    core = _core()
    r = _req("lp", n_in=6, n_out=3)
    r.return_logprob, r.logprob_start_len, r.top_logprobs_num = True, 2, 2
    assert core.add(r, 0.0)
    msgs = _drive(core)
    toks = [ids for m in msgs if isinstance(m, Tokens) for rid, ids in m.items if rid == "lp"]
    fin = [m for m in msgs if isinstance(m, Finished)]
    assert [t for ids in toks for t in ids] == list(fin[0].output_ids) and len(toks) == 3
    f = fin[0]
    assert f.reason is FinishReason.LENGTH and f.worker == 3 and f.ok
    assert all(259 <= t < 32000 for t in f.output_ids)
    assert len(f.input_logprobs) == 6 - 2 and None not in f.input_logprobs
    assert len(f.output_logprobs) == 3 and all(x < 0 for x in f.output_logprobs)
    assert [row[0][1] for row in f.output_top_logprobs] == list(f.output_ids)
    assert any(isinstance(m, Load) for m in msgs)
    assert not core.requests


def test_worker_core_abort_during_a_step_waits_for_it() -> None:
    core = _core()
    r = _req("x", n_out=50)
    core.add(r, 0.0)
    result = core.step(0.0)
    assert core.abort("x", 0.001, "client left")  # mid-step: deferred, not refused
    core.complete(result, 0.01)
    msgs = core.drain(0.01).messages
    fin = [m for m in msgs if isinstance(m, Finished)]
    assert fin and fin[0].reason is FinishReason.ABORTED and fin[0].error == "client left"
    assert not fin[0].ok and core.idle
    assert not core.abort("x", 0.02)  # gone: idempotent


def test_worker_core_rejection_is_reported() -> None:
    core = _core()
    big = _req("big", n_in=500)
    assert not core.add(big, 0.0)
    fin = [m for m in core.drain(0.0).messages if isinstance(m, Finished)]
    assert fin[0].reason is FinishReason.REJECTED and "KV" in fin[0].error
    assert core.add(_req("dup"), 0.0)
    with pytest.raises(ValueError):
        core.add(_req("dup"), 0.0)


@pytest.mark.parametrize("keep_log", [True, False])
def test_a_live_worker_forgets_what_it_reported(keep_log: bool) -> None:
    """keep_log=False (live workers): after each drain the scheduler's log holds nothing, and
    every request is still reported exactly once. Before, a live worker kept every finished
    request (its prompt included) and every service event forever: ~12 KB per request."""
    core = _core(keep_log=keep_log)
    finished: list[str] = []
    t = 0.0
    for wave in range(3):
        for i in range(5):
            assert core.add(_req(f"w{wave}-{i}", n_in=8, n_out=4), t)
        msgs = _drive(core, t)
        finished += [m.rid for m in msgs if isinstance(m, Finished)]
        t += 10.0
    assert sorted(finished) == sorted(f"w{w}-{i}" for w in range(3) for i in range(5))
    log = core.scheduler.log
    if keep_log:
        assert len(log.done) == 15 and log.events
    else:
        assert log.done == [] and log.events == []
