"""``Request.queue_s``: seconds in the waiting queue, summed over every wait (SGLang's
``meta_info.queue_time``), as the scheduler measures it and the worker reports it."""

from __future__ import annotations

import pytest
from conftest import FixedEngine, drive, make_scheduler, unique_tokens

from sgl_fair.messages import Finished
from sgl_fair.request import Request
from sgl_fair.worker.service import WorkerCore


def test_a_request_that_waits_for_memory_counts_the_wait() -> None:
    # 20 tokens of KV: one 10 + 5 request at a time, so the second waits for the first.
    sched = make_scheduler("fcfs", capacity=20)
    first = Request("a", "c", unique_tokens(10), 5, 0.0)
    second = Request("b", "c", unique_tokens(10), 5, 0.0)
    drive(sched, FixedEngine(prefill_s=0.02, decode_s=0.01), [first, second])
    assert first.queue_s == 0.0
    assert second.admit_s == pytest.approx(first.finish_s)
    assert second.queue_s == pytest.approx(second.admit_s - second.arrival_s)
    assert second.queue_s == pytest.approx(0.06)  # 1 prefill + 4 decode steps of the first


def test_a_retracted_request_adds_its_second_wait() -> None:
    sched = make_scheduler("fcfs", capacity=600, init_new_token_ratio=0.3, min_new_token_ratio=0.05)
    reqs = [Request(f"r{i}", "abcd"[i % 4], unique_tokens(40), 100, 0.02 * i) for i in range(8)]
    waits: dict[int, float] = {}  # id -> the first wait, recorded at first admission

    def after_step(s, batch, now) -> None:
        for c in batch.prefill:
            if c.req.num_retractions == 0 and id(c.req) not in waits:
                waits[id(c.req)] = c.req.queue_s

    drive(sched, FixedEngine(), reqs, after_step=after_step)
    retracted = [r for r in reqs if r.num_retractions]
    assert retracted
    for r in reqs:
        assert r.queued_s is None  # no wait left open
        assert r.queue_s == pytest.approx(waits[id(r)]) if not r.num_retractions else True
        assert 0.0 <= r.queue_s <= r.finish_s - r.arrival_s
    for r in retracted:  # the wait after the retraction counts too
        assert r.queue_s > waits[id(r)]
        assert r.queue_s > r.admit_s - r.arrival_s


def test_the_worker_reports_the_wait_and_none_for_a_rejected_request() -> None:
    core = WorkerCore(0, make_scheduler("fcfs", capacity=20), FixedEngine())
    ok = [Request(f"r{i}", "c", unique_tokens(10), 5, 0.0) for i in range(2)]
    too_big = Request("big", "c", unique_tokens(30), 5, 0.0)  # never fits: rejected
    assert [core.add(req, 0.0) for req in (*ok, too_big)] == [True, True, False]
    now, finished = 0.0, {}
    for _ in range(100):
        result = core.step(now)
        if result is None:
            break
        now += result.duration_s
        core.complete(result, now)
        finished.update((m.rid, m) for m in core.drain(now).messages if isinstance(m, Finished))
    assert finished["r0"].queue_s == 0.0
    assert finished["r1"].queue_s == pytest.approx(ok[1].queue_s) and finished["r1"].queue_s > 0
    assert finished["big"].queue_s is None
