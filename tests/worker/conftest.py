"""Helpers for driving the real scheduler on a CPU: a fixed-cost engine, workloads, a step loop.

Nothing here is a mock: ``FixedEngine`` is a complete ``Engine`` (durations and token ids
are fixed instead of computed), and ``drive`` is the same step → run → apply loop as
``worker.sim.runner.simulate``, with hooks so tests can look at every state in between.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.kv import KVUsage, PrefixKVCache, TokenAllocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig

# Generated token ids live above every prompt id, so outputs never match a cached prompt.
OUTPUT_TOKEN_BASE = 1 << 30


class FixedEngine:
    """Every prefill step takes ``prefill_s``, every decode step ``decode_s``; ids count up."""

    def __init__(self, *, prefill_s: float = 0.02, decode_s: float = 0.01) -> None:
        self.prefill_s = prefill_s
        self.decode_s = decode_s
        self._token_ids = itertools.count(OUTPUT_TOKEN_BASE)

    def run(self, batch: Batch) -> StepResult:
        duration = self.prefill_s if batch.is_prefill else self.decode_s
        tokens = [next(self._token_ids) for _ in batch.sampling_requests()]
        return StepResult(batch, duration, tokens)


def make_scheduler(policy: str = "fcfs", *, capacity: int, **config: float) -> Scheduler:
    """A real scheduler over a real radix cache on a token pool of ``capacity`` tokens."""
    kv = PrefixKVCache(TokenAllocator(capacity))
    return Scheduler(policy=make_policy(policy), kv=kv, config=SchedulerConfig(**config))


def assert_kv_conserved(scheduler: Scheduler) -> KVUsage:
    """free + cached + locked + private == capacity, every term >= 0, structures consistent."""
    kv = scheduler.kv
    kv.check_invariants()
    usage = kv.usage()
    assert min(usage) >= 0, usage
    assert sum(usage) == kv.capacity_tokens, f"{usage} != capacity {kv.capacity_tokens}"
    return usage


def assert_in_flight_consistent(scheduler: Scheduler, batch: Batch) -> None:
    """Between ``step`` and ``apply``: who holds a prefix handle, and where everyone is.

    Stated from the batch, independently of the scheduler's own bookkeeping: handles ==
    running + chunked + every request this batch prefills.
    """
    in_flight = {id(r) for r in scheduler.running}
    if scheduler.chunked is not None:
        in_flight.add(id(scheduler.chunked))
    in_flight |= {id(c.req) for c in batch.prefill}
    assert in_flight == {id(r) for r in scheduler.handles}, "prefix handles leaked or missing"
    waiting = {id(r) for r in scheduler.waiting}
    assert not waiting & in_flight, "a request is both waiting and scheduled"
    assert_waiting_in_arrival_order(scheduler)
    for req in scheduler.running:
        held = scheduler.kv.allocator.held(req)
        assert held >= 1, f"{req} runs without a private KV slot"


def assert_prefix_lens_fresh(scheduler: Scheduler) -> None:
    """What policies are told is cached (memoized across steps) equals a fresh tree match."""
    for req in scheduler.waiting:
        fresh = scheduler.kv.match_len(req.all_ids())
        assert scheduler.prefix_len(req) == fresh, f"{req}: stale prefix_len, tree says {fresh}"


def assert_waiting_in_arrival_order(scheduler: Scheduler) -> None:
    """The waiting queue stays sorted by arrival, retracted requests included."""
    keys = [r.arrival_key() for r in scheduler.waiting]
    assert keys == sorted(keys), "waiting queue out of arrival order"


@dataclass
class Trace:
    """What ``drive`` saw: each batch with its start time, and idle moments."""

    steps: list[tuple[float, Batch]] = field(default_factory=list)
    num_idle: int = 0


StepHook = Callable[[Scheduler, Batch, float], None]


def drive(
    scheduler: Scheduler,
    engine,
    requests: Sequence[Request],
    *,
    after_step: StepHook | None = None,
    after_apply: StepHook | None = None,
    before_step: Callable[[Scheduler, float], None] | None = None,
    max_steps: int = 200_000,
    token_pool: bool = True,
) -> Trace:
    """Run ``requests`` to completion in virtual time, checking invariants at every state.

    After every ``step`` and every ``apply``: KV conservation and ``check_invariants``
    (``token_pool=False``, block allocators: ``check_invariants`` only — fragmentation and
    KV checkpointed to host make the token equations not hold, and no request in a batch may
    have KV on the host); before
    every step: the waiting queue's prefix lengths are fresh. Arrivals that land during a step
    join at its end (as in ``simulate``). When the scheduler idles it must have nothing at all
    to do; the clock then jumps to the next arrival.
    """
    arrivals = sorted(requests, key=Request.arrival_key)
    trace = Trace()
    now, i = 0.0, 0
    for _ in range(max_steps):
        while i < len(arrivals) and arrivals[i].arrival_s <= now:
            scheduler.add_request(arrivals[i], arrivals[i].arrival_s)
            i += 1
        assert_prefix_lens_fresh(scheduler)
        if before_step is not None:
            before_step(scheduler, now)
        batch = scheduler.step(now)
        if batch is None:
            trace.num_idle += 1
            assert not scheduler.has_work(), (
                f"idle with work: waiting={scheduler.waiting} running={scheduler.running} "
                f"chunked={scheduler.chunked}"
            )
            if i == len(arrivals):
                return trace
            now = arrivals[i].arrival_s
            continue
        if token_pool:
            assert_kv_conserved(scheduler)
            assert_in_flight_consistent(scheduler, batch)
        else:
            for req in (*(c.req for c in batch.prefill), *batch.decode):
                assert scheduler.checkpointed_slots(req) == 0, f"{req} runs with KV on the host"
        scheduler.check_invariants()
        if after_step is not None:
            after_step(scheduler, batch, now)
        trace.steps.append((now, batch))
        result = engine.run(batch)
        now += result.duration_s
        scheduler.apply(result, now)
        if token_pool:
            assert_kv_conserved(scheduler)
        scheduler.check_invariants()
        assert_waiting_in_arrival_order(scheduler)
        if after_apply is not None:
            after_apply(scheduler, batch, now)
    raise AssertionError(f"no completion within {max_steps} steps")


def prefix_tokens(index: int, length: int) -> tuple[int, ...]:
    """A shared system prompt: prefix ``index`` never shares a token with another prefix."""
    base = 1_000_000 * (index + 1)
    return tuple(range(base, base + length))


_suffix_ids = itertools.count(1)


def unique_tokens(length: int) -> tuple[int, ...]:
    """Tokens no other call returns (below every prefix id and every output id)."""
    return tuple(next(_suffix_ids) % 999_999 + 1 for _ in range(length))


def shared_prefix_workload(
    seed: int,
    *,
    num_requests: int,
    num_prefixes: int = 3,
    prefix_len: int = 64,
    suffix_len: tuple[int, int] = (1, 40),
    output_len: tuple[int, int] = (1, 40),
    clients: Sequence[str] = ("a", "b", "c"),
    mean_gap_s: float = 0.02,
) -> list[Request]:
    """Seeded requests whose prompts start with one of ``num_prefixes`` shared prefixes."""
    rng = random.Random(seed)
    prefixes = [prefix_tokens(k, prefix_len) for k in range(num_prefixes)]
    now = 0.0
    reqs = []
    for n in range(num_requests):
        now += rng.expovariate(1 / mean_gap_s)
        prompt = rng.choice(prefixes) + unique_tokens(rng.randint(*suffix_len))
        reqs.append(
            Request(f"r{n}", rng.choice(list(clients)), prompt, rng.randint(*output_len), now)
        )
    return reqs


def assert_finished_exactly(requests: Sequence[Request]) -> None:
    """Every request produced exactly ``output_len`` tokens, with consistent timestamps."""
    for r in requests:
        assert r.num_output == r.output_len, r
        assert r.first_token_s is not None and r.finish_s is not None, r
        assert r.admit_s is not None and r.admit_s >= r.arrival_s, r
        assert r.admit_s <= r.first_token_s <= r.finish_s, r


def assert_private_kv_exact(scheduler: Scheduler) -> None:
    """After ``apply``: each in-flight request privately holds exactly its uncommitted tokens.

    A running request's committed prefix ends where its handle ends; beyond it it holds the
    tokens it decoded since plus one slot for the token it feeds next (so ``seq_len - prefix``).
    A chunked request holds exactly the chunks computed past its cached prefix.
    """
    held = scheduler.kv.allocator.held
    for req in scheduler.running:
        committed = scheduler.handles[req].prefix_len
        assert held(req) == req.seq_len - committed, (req, held(req), committed)
    if scheduler.chunked is not None:
        req = scheduler.chunked
        committed = scheduler.handles[req].prefix_len
        assert held(req) == req.num_computed - committed, (req, held(req), committed)
