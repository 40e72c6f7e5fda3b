"""Exact KV slots, proven by contents: a pure-Python engine that keeps what each device and
host slot holds, checks every position a step reads and writes the positions it computes.

``ContentEngine`` plays a real engine over ``PrefixKVCache(exact=True)``: for each batch it
does ``batch.kv_copies`` in order (device <-> host), then per prefill chunk ``(req, start, n)``
asserts that slot ``kv_slots(req)[p]`` holds ``ident(req, p)`` for every ``p < start`` and
writes positions ``[start, start + n)``; per decode it checks ``p < seq_len - 1`` and writes
``seq_len - 1``. ``ident(req, p)`` is a chain hash of ``req.all_ids()[:p + 1]`` (KV at p
depends on every token up to p), so a prefix computed by another request checks equal. It
also asserts that no slot has two owners. Before exact mode (count-only commits, eviction of
"CACHE's last n tokens") this failed within a few examples.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from conftest import assert_finished_exactly, drive, unique_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.policies import make_policy
from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.kv import CACHE, PrefixKVCache, TokenAllocator
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine, synthetic_token

COST = CostModel.from_names("A10G", "Llama-2-7B")
RT, BE = ServiceClass.RT, ServiceClass.BE
ALLOCATORS = [
    ("token", 1),
    ("paged", 1),
    ("paged", 8),
    ("paged", 16),
    ("bidirectional", 8),
    ("bidirectional", 16),
]
POLICIES = ["fcfs", "lpm", "vtc", "dlpm", "bros"]


class ContentEngine:
    """A real engine's KV bookkeeping without tensors; durations and tokens from ``SimEngine``."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.sim = SimEngine(COST)
        self.block_size = sched.kv.allocator.block_size
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self._idents: dict[str, list[int]] = {}
        self.num_reads = 0
        self.num_copies = 0

    def ident(self, req: Request, upto: int) -> list[int]:
        """Chain hashes of ``req``'s tokens: entry p stands for ``all_ids()[:p + 1]``."""
        ids, h = req.all_ids(), self._idents.setdefault(req.rid, [])
        while len(h) < upto:
            h.append(hash((h[-1] if h else 0, ids[len(h)])))
        return h

    def run(self, batch: Batch) -> StepResult:
        size = self.block_size
        for c in batch.kv_copies:
            self.num_copies += 1
            for i in range(c.num_tokens):
                dev, host = c.block * size + c.slot + i, c.host_offset + i
                if c.to_host:
                    self.host[host] = self.device.get(dev)
                else:
                    self.device[dev] = self.host.get(host)
        self.check_owners()
        for chunk in batch.prefill:
            self.compute(chunk.req, chunk.start, chunk.start + chunk.num_tokens)
        for req in batch.decode:
            self.compute(req, req.seq_len - 1, req.seq_len)
        return self.sim.run(batch)

    def compute(self, req: Request, start: int, end: int) -> None:
        """Read positions [0, start), write [start, end)."""
        slots = self.sched.kv_slots(req)
        assert len(slots) >= end, f"{req.rid}: {len(slots)} slots, the step needs {end}"
        assert len(set(slots)) == len(slots), f"{req.rid}: a slot twice in its kv_slots"
        ident = self.ident(req, end)
        for p in range(start):
            got = self.device.get(slots[p])
            assert got == ident[p], f"{req.rid}: wrong KV at position {p} (slot {slots[p]})"
        self.num_reads += start
        for p in range(start, end):
            self.device[slots[p]] = ident[p]

    def check_owners(self) -> None:
        alloc, seen = self.sched.kv.allocator, {}
        for owner in alloc.owners():
            for s in alloc.flat_slots(owner):
                assert s not in seen, f"slot {s} held by {seen[s]!r} and {owner!r}"
                seen[s] = owner


def workload(seed: int, num: int, classes: bool) -> tuple[list[Request], list[tuple]]:
    """Shared long prefixes arriving in bursts, multi-turn follow-ups, fresh prompts; aborts."""
    rng = random.Random(seed)
    prefixes = [unique_tokens(rng.randint(8, 60)) for _ in range(2)]
    bursts = [rng.uniform(0, 0.6) for _ in range(3)]
    reqs: list[Request] = []
    for i in range(num):
        kind = rng.random()
        t = rng.choice(bursts) + rng.uniform(0, 0.01)
        if kind < 0.5:
            prompt = rng.choice(prefixes) + unique_tokens(rng.randint(1, 30))
        elif kind < 0.75 and reqs:  # the next turn: an earlier prompt + its output + more
            prev = rng.choice(reqs)
            out = tuple(synthetic_token(prev.rid, k) for k in range(prev.output_len))
            prompt = prev.input_ids + out + unique_tokens(rng.randint(1, 20))
            t = prev.arrival_s + rng.uniform(0, 0.5)
        else:
            prompt = unique_tokens(rng.randint(1, 80))
        cls = rng.choice([RT, BE]) if classes else BE
        client = rng.choice("abc")
        reqs.append(
            Request(f"r{i}", client, prompt[:200], rng.randint(1, 30), t, service_class=cls)
        )
    aborts = [(r.arrival_s + rng.uniform(0, 0.4), r) for r in reqs if rng.random() < 0.2]
    return reqs, sorted(aborts, key=lambda a: a[0])


def run_exact(reqs, aborts, policy, allocator, block_size, capacity, guard):
    """Drive to completion through a ``ContentEngine``; invariants after every step and apply."""
    if allocator == "token":
        alloc = TokenAllocator(capacity)  # PrefixKVCache(exact=True) gives it slot ids
    else:
        alloc = make_allocator(allocator, capacity, block_size=block_size)
    kv = PrefixKVCache(alloc, exact=True)
    cfg = SchedulerConfig(share_guard=guard)
    sched = Scheduler(policy=make_policy(policy), kv=kv, config=cfg, cost=COST.step_time)
    engine, aborts = ContentEngine(sched), list(aborts)

    def abort_due(s: Scheduler, now: float) -> None:
        while aborts and aborts[0][0] <= now:
            s.abort(aborts.pop(0)[1], now)

    drive(sched, engine, reqs, before_step=abort_due, token_pool=False, max_steps=100_000)
    done = (Phase.FINISHED, Phase.ABORTED, Phase.REJECTED)
    assert all(r.phase in done for r in reqs), [r for r in reqs if r.phase not in done]
    assert_finished_exactly([r for r in reqs if r.phase is Phase.FINISHED])
    assert set(alloc.owners()) <= {CACHE} and not kv.tree.locked_tokens, "KV leaked"
    kv._evict(kv.tree.total_tokens)  # `flush`, which refuses while blocks hold fragments
    assert not kv.tree.total_tokens and alloc.num_free_tokens() == alloc.capacity_tokens
    kv.check_invariants()
    return engine, sched


@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: f"{a[0]}-{a[1]}")
def test_workloads_reach_copies_evictions_retractions_and_aborts(allocator) -> None:
    name, block_size = allocator
    seen: Counter = Counter()
    for seed in range(8):
        reqs, aborts = workload(seed, 14, classes=name == "bidirectional")
        policy, guard = POLICIES[seed % len(POLICIES)], seed % 2 == 0
        engine, sched = run_exact(reqs, aborts, policy, name, block_size, 256, guard)
        seen["runs"] += 1
        seen["reads"] += engine.num_reads
        seen["copies"] += engine.num_copies
        seen["evicted"] += sched.kv.num_evicted_tokens
        seen["retracted"] += sched.stats.num_retractions
        seen["aborted"] += sum(r.phase is Phase.ABORTED and r.admit_s is not None for r in reqs)
    assert seen["runs"] == 8, seen
    assert min(seen[k] for k in ("reads", "evicted", "retracted", "aborted")) > 0, seen
    assert (seen["copies"] > 0) == (name == "bidirectional"), seen


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 10**9),
    st.integers(2, 16),
    st.sampled_from(POLICIES),
    st.sampled_from(ALLOCATORS),
    st.sampled_from([256, 400, 640]),
    st.booleans(),
)
def test_every_read_finds_the_kv_written_for_it(seed, num, policy, allocator, capacity, guard):
    name, block_size = allocator
    reqs, aborts = workload(seed, num, classes=name == "bidirectional")
    run_exact(reqs, aborts, policy, name, block_size, capacity, guard)
