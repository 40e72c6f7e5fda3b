"""Liveness, as a property (SPEC §0 (3), work-conserving; issue 31): over random mixes of
policies × KV allocators (token, paged, bidirectional) × chunked-prefill sizes (64–8,192) ×
pool sizes down to a few requests × RT/BE classes × shared prefixes × aborts, a worker
never idles while it has work — a step with a request waiting, running or mid-prefill
returns a batch (nothing is left running, so every waiting request fits the free +
evictable KV: ``add_request`` rejects one that could never fit) — no step raises, and every
request ends (finished with all its tokens, aborted or rejected) within a step bound.

Before issue 31's fixes this found: BROS on bidirectional blocks idling for good with a
chunked BE prompt whose slots RT growth had checkpointed, and paged/bidirectional blocks
idling (or raising MemoryError) on a request whose cached prefix ends mid-block.

``make test`` runs a seeded (derandomized) handful of examples; set
``SGLFAIR_PROPERTY_EXAMPLES=N`` for a wider, randomized run (``make bench`` does, through
``bench/bench_liveness.py``).
"""

from __future__ import annotations

import os
import random

from conftest import FixedEngine
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sgl_fair.policies import make_policy
from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel

WIDE = int(os.environ.get("SGLFAIR_PROPERTY_EXAMPLES", "0"))
EXAMPLES = WIDE or 40
POLICIES = ("fcfs", "lpm", "vtc", "lcf", "dlpm", "preble-local", "rr", "bros", "fairserve")
ALLOCATORS = ("token", "paged", "bidirectional")
COST = CostModel.from_names("A10G", "Llama-2-7B").step_time
ENDED = (Phase.FINISHED, Phase.ABORTED, Phase.REJECTED)


def workload(rng: random.Random, num: int, block: int) -> list[Request]:
    """RT chat and BE batches over a few shared prefixes whose lengths end mid-block."""
    prefixes = [
        tuple(range(1_000_000 * (k + 1), 1_000_000 * (k + 1) + rng.randint(1, 6 * block + 3)))
        for k in range(rng.randint(1, 3))
    ]
    out, now, fresh = [], 0.0, iter(range(1, 1 << 30))
    for i in range(num):
        now += rng.expovariate(1 / 0.02) if rng.random() < 0.7 else 0.0
        rt = rng.random() < 0.5
        head = rng.choice(prefixes) if rng.random() < 0.6 else ()
        tail = tuple(next(fresh) for _ in range(rng.randint(1, 96 if rt else 256)))
        out.append(
            Request(f"r{i}", f"c{rng.randrange(3)}", head + tail, rng.randint(1, 64), now,
                    service_class=ServiceClass.RT if rt else ServiceClass.BE)
        )  # fmt: skip
    return out


def run_mix(
    seed: int, policy: str, allocator: str, chunk: int, pool_requests: float, aborts: bool
) -> Scheduler:
    """Drive one random mix to its end, asserting liveness at every step."""
    rng = random.Random(seed)
    block = rng.choice((4, 8, 16)) if allocator != "token" else 1
    reqs = workload(rng, rng.randint(4, 40), block)
    biggest = max(r.input_len + r.max_new_tokens for r in reqs)
    capacity = max(int(biggest * pool_requests), biggest) + block - 1  # whole blocks >= biggest
    opts = {} if allocator == "token" else {"block_size": block}
    kv = PrefixKVCache(make_allocator(allocator, capacity, **opts))
    cfg = SchedulerConfig(
        chunked_prefill_size=chunk,
        max_running_requests=rng.choice((2, 8, 256)),
        share_guard=rng.random() < 0.25 and policy in ("vtc", "dlpm", "fairserve"),
    )
    sched = Scheduler(policy=make_policy(policy), kv=kv, config=cfg, cost=COST)
    engine = FixedEngine()
    arrivals = sorted(reqs, key=Request.arrival_key)
    now, i, steps = 0.0, 0, 0
    limit = 50 * sum(r.input_len + r.output_len for r in reqs) + 1000
    while True:
        while i < len(arrivals) and arrivals[i].arrival_s <= now:
            sched.add_request(arrivals[i], arrivals[i].arrival_s)
            i += 1
        if aborts and rng.random() < 0.03:
            live = [r for r in reqs[:i] if r.phase not in ENDED]
            if live:
                sched.abort(rng.choice(live), now)
        batch = sched.step(now)
        if batch is None:
            assert not sched.has_work(), (
                f"idle with work: waiting={len(sched.waiting)} running={len(sched.running)} "
                f"chunked={sched.chunked}"
            )
            if i == len(arrivals):
                break
            now = arrivals[i].arrival_s
            continue
        sched.check_invariants()
        result = engine.run(batch)
        now += result.duration_s
        sched.apply(result, now)
        steps += 1
        assert steps < limit, f"no end within {limit} steps (livelock)"
    sched.check_invariants()
    for r in reqs:
        assert r.phase in ENDED, r
        if r.phase is Phase.FINISHED:
            assert r.num_output == r.output_len, r
    return sched


@settings(
    max_examples=EXAMPLES,
    derandomize=not WIDE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(
    seed=st.integers(0, 2**32 - 1),
    policy=st.sampled_from(POLICIES),
    allocator=st.sampled_from(ALLOCATORS),
    chunk=st.sampled_from((64, 128, 256, 512, 1024, 8192)),
    pool_requests=st.sampled_from((1.0, 1.5, 2.0, 4.0, 16.0)),
    aborts=st.booleans(),
)
# What it found before issue 31's fixes (each failed then): idle with 23 waiting (paged, a
# cached prefix ending mid-block); MemoryError for a lone running request with room in its
# own block (paged); idle for good with a checkpointed chunked BE prompt (BROS, bidirectional).
@example(seed=0, policy="fcfs", allocator="paged", chunk=64, pool_requests=1.0, aborts=False)
@example(seed=0, policy="lpm", allocator="paged", chunk=64, pool_requests=1.0, aborts=False)
@example(seed=0, policy="bros", allocator="bidirectional", chunk=64, pool_requests=1, aborts=False)
def test_never_idle_with_admissible_work_and_everything_ends(
    seed: int, policy: str, allocator: str, chunk: int, pool_requests: float, aborts: bool
) -> None:
    run_mix(seed, policy, allocator, chunk, pool_requests, aborts)
