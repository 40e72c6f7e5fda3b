"""Issue 31's liveness defects, each as the smallest run that showed it (the property that
finds such runs is ``test_liveness_property.py``).

1. BROS on bidirectional blocks with chunked prefill: a BE prompt split over steps lost its
   pin at the next step, RT growth checkpointed its slots to host, and the rest of the prompt
   was never continued (``can_allocate`` refuses a checkpointed BE request) while a pending
   chunked prompt blocks every admission: the worker idled for good. Before the fix, on
   ``bros-bicache``'s setting (12k-token pool, block 16) at 6 RT req/s: 11 of 38 RT requests
   never finished at chunk 256 (5 s), 5 of 38 at 512, 42 of 104 at 1024 (15 s); 60 s runs:
   372, 372 and 324 of 387.
2. Block allocators (paged, bidirectional): a request whose cached prefix ends mid-block
   needs one more block than its tokens; with its prefix locked by the admission walk it
   never fits, the walk stops, and nothing else holds KV to free: idle with work. Before:
   idle with 1 waiting.
3. The same block accounting raised ``MemoryError`` for a lone running request that had
   room in its own last block (``_ensure_decode_memory`` counted free blocks only).
"""

from __future__ import annotations

import pytest
from conftest import FixedEngine, assert_finished_exactly, drive
from test_liveness_property import run_mix

from sgl_fair.experiment.bros_workload import BEJob, drive_hybrid, rt_requests
from sgl_fair.policies import make_policy
from sgl_fair.request import Request, ServiceClass
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker


@pytest.mark.parametrize(("chunk", "duration_s"), [(256, 5.0), (512, 5.0), (1024, 15.0)])
def test_bros_bidirectional_chunked_be_prompt_is_restored_and_finishes(
    chunk: int, duration_s: float
) -> None:
    cost = CostModel.from_names("A100-80GB", "Llama-3-70B", 8)
    sched, engine = make_sim_worker(
        policy=make_policy("bros"), cost_model=cost, kv_tokens=12_000,
        config=SchedulerConfig(chunked_prefill_size=chunk), allocator="bidirectional",
        allocator_opts={"block_size": 16},
    )  # fmt: skip
    rt = rt_requests(6.0, duration_s, 0)
    drive_hybrid(sched, engine, rt, BEJob(0), duration_s)
    unfinished = [r for r in rt if r.finish_s is None]
    assert not unfinished, f"{len(unfinished)} of {len(rt)} RT requests never finished"
    assert sched.chunked is None and not sched.waiting
    sched.check_invariants()


def blocks_scheduler(allocator: str, policy: str = "fcfs", **config) -> Scheduler:
    kv = PrefixKVCache(make_allocator(allocator, 16, block_size=4))  # 4 blocks of 4
    cfg = SchedulerConfig(**config)
    cost = CostModel.from_names("A10G", "Llama-2-7B").step_time
    return Scheduler(policy=make_policy(policy), kv=kv, config=cfg, cost=cost)


@pytest.mark.parametrize("allocator", ["paged", "bidirectional"])
@pytest.mark.parametrize("policy", ["fcfs", "bros"])
def test_a_request_whose_cached_prefix_ends_mid_block_is_admitted(
    allocator: str, policy: str
) -> None:
    sched = blocks_scheduler(allocator, policy)
    cls = ServiceClass.RT if policy == "bros" else ServiceClass.BE
    head = tuple(range(100, 106))  # 6 tokens: cached in 1.5 blocks of 4
    a = Request("a", "x", head, 1, 0.0, service_class=cls)
    # 12 + 4 = 16 tokens, the whole pool; behind its 6-token prefix it needs 2 + 3 blocks.
    b = Request("b", "x", head + tuple(range(200, 206)), 4, 1.0, service_class=cls)
    c = Request("c", "y", tuple(range(300, 304)), 2, 1.0, service_class=cls)
    drive(sched, FixedEngine(), [a, b, c], token_pool=False)
    assert_finished_exactly([a, b, c])


def test_a_lone_running_request_with_room_in_its_own_block_is_not_out_of_memory() -> None:
    """Paged: the only running request (its cached prefix ending mid-block) has room in its
    last block, no free block is left; before, ``_ensure_decode_memory`` raised MemoryError
    (free blocks < 1). The run the property found (LPM, block 8, a 296-token pool)."""
    sched = run_mix(0, "lpm", "paged", 64, 1.0, False)
    assert sched.stats.num_decode_steps > 0
