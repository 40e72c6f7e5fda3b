"""BROS's ``recompute_blocked`` (the paper's "No Bi-cache" baseline, §7.4: "we simply perform
recomputation for requests failing to acquire cache blocks"; vLLM's way): a chosen running
request that finds no KV block for its next token is itself retracted, RT included, and the
request that still has room in its own block keeps its KV. By default the scheduler retracts
a paused or other request for it instead (BE first).

A tiny paged pool (9 blocks of 4 slots), one RT and one BE request, output reservation off
(``clip_max_new_tokens=1``: vLLM admits on the prompt's blocks alone), so the two outgrow
the pool; the step where that happens is checked to be the one the test means.
"""

from __future__ import annotations

import pytest
from conftest import unique_tokens

from sgl_fair.policies import make_policy
from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.kv import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine

COST = CostModel.from_names("A10G", "Llama-2-7B")
NO_BICACHE = {"preempt_be": False, "recompute_blocked": True}


def _until_blocked(options: dict):
    """Run until the first step in which the RT request needs a new block and none is free
    (the BE request still has room in its last block); return the scheduler, the two
    requests and that step's batch."""
    alloc = make_allocator("paged", 36, block_size=4)
    sched = Scheduler(
        policy=make_policy("bros", **options),
        kv=PrefixKVCache(alloc),
        config=SchedulerConfig(clip_max_new_tokens=1),
        cost=COST.step_time,
    )
    engine = SimEngine(COST)
    rt = Request("rt", "chat", unique_tokens(4), 30, 0.0, service_class=ServiceClass.RT)
    be = Request("be", "batch", unique_tokens(5), 30, 0.0, service_class=ServiceClass.BE)
    sched.add_request(rt, 0.0)
    sched.add_request(be, 0.0)
    now = 0.0
    for _ in range(40):
        running = rt.phase is Phase.RUNNING and be.phase is Phase.RUNNING
        blocked = running and not alloc.layout.free_blocks and alloc.room(rt) == 0
        if blocked:
            assert alloc.room(be) > 0 and rt.num_retractions == be.num_retractions == 0
        batch = sched.step(now)
        assert batch is not None
        if blocked:
            return sched, rt, be, batch
        result = engine.run(batch)
        now += result.duration_s
        sched.apply(result, now)
        sched.check_invariants()
    raise AssertionError("the two requests never outgrew the pool")


def test_no_bicache_retracts_the_rt_request_that_found_no_block():
    sched, rt, be, batch = _until_blocked(NO_BICACHE)
    assert rt.num_retractions == 1 and rt.phase is Phase.WAITING
    assert rt not in batch.decode
    # The BE request had room in its own block: it keeps its KV and decodes.
    assert be.num_retractions == 0 and be in batch.decode
    sched.check_invariants()


def test_by_default_the_blocked_rt_request_takes_the_be_requests_kv():
    sched, rt, be, batch = _until_blocked({})
    assert be.num_retractions == 1 and be.phase is Phase.WAITING
    assert rt.num_retractions == 0 and rt in batch.decode
    sched.check_invariants()


def test_recompute_blocked_must_be_a_bool():
    with pytest.raises(ValueError, match="recompute_blocked must be true or false"):
        make_policy("bros", recompute_blocked="yes")
