"""Discrete-event driver: one worker in virtual time.

Time only moves by engine step durations and by jumping to the next arrival
when the worker is idle, so a 10-minute experiment takes seconds of CPU.
Arrivals that land during a step join the queue at the step's end, as they
would in a live continuous-batching loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import Policy
from sgl_fair.records import RequestRecord
from sgl_fair.request import Request
from sgl_fair.worker.engine import Engine
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import RunLog, Scheduler, SchedulerConfig, SchedulerStats
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine
from sgl_fair.worker.sim.text import TextModel


@dataclass
class SimResult:
    log: RunLog
    submitted: list[Request]
    t_end_s: float
    wall_s: float
    busy_s: float
    stats: SchedulerStats
    kv_capacity_tokens: int
    unfinished: int

    def records(self) -> list[RequestRecord]:
        """A record for every submitted request, finished or not (metrics need demand too)."""
        return [RequestRecord.from_request(r) for r in self.submitted]

    @property
    def speedup(self) -> float:
        """Virtual seconds simulated per wall-clock second."""
        return self.t_end_s / self.wall_s if self.wall_s > 0 else float("inf")


def make_sim_worker(
    *,
    policy: Policy,
    cost_model: CostModel,
    kv_tokens: int | None = None,
    config: SchedulerConfig | None = None,
    token_range: tuple[int, int] | None = None,
    allocator: str = "token",
    allocator_opts: dict | None = None,
    text: TextModel | None = None,
    eos_token_id: int | None = None,
) -> tuple[Scheduler, SimEngine]:
    """A scheduler + simulated engine pair; the KV pool is derived from memory unless given.
    ``allocator``: the KV allocator's registry name (``sgl_fair.worker.kv.allocator_names``)
    with its ``allocator_opts``."""
    capacity = kv_tokens if kv_tokens is not None else cost_model.kv_capacity_tokens()
    kv = PrefixKVCache(make_allocator(allocator, capacity, **(allocator_opts or {})))
    engine = SimEngine(cost_model, token_range=token_range, text=text, eos_token_id=eos_token_id)
    scheduler = Scheduler(policy=policy, kv=kv, config=config, cost=cost_model.step_time)
    return scheduler, engine


def simulate(
    requests: Sequence[Request],
    *,
    scheduler: Scheduler,
    engine: Engine,
    until_s: float | None = None,
    check_every: int = 0,
) -> SimResult:
    """Run ``requests`` through one worker until all finish (or virtual time ``until_s``).

    ``check_every=k`` calls ``scheduler.check_invariants()`` every k steps (tests).
    """
    arrivals = sorted(requests, key=Request.arrival_key)
    wall0 = time.perf_counter()
    now = 0.0
    i, n = 0, len(arrivals)
    num_steps = 0
    busy_s = 0.0
    while True:
        while i < n and arrivals[i].arrival_s <= now:
            scheduler.add_request(arrivals[i], arrivals[i].arrival_s)
            i += 1
        if until_s is not None and now >= until_s:
            break
        batch = scheduler.step(now)
        if batch is None:
            if i < n:
                now = arrivals[i].arrival_s
                continue
            break
        result = engine.run(batch)
        now += result.duration_s
        busy_s += result.duration_s
        scheduler.apply(result, now)
        num_steps += 1
        if check_every and num_steps % check_every == 0:
            scheduler.check_invariants()
    if check_every:
        scheduler.check_invariants()
    unfinished = len(scheduler.waiting) + len(scheduler.running) + (scheduler.chunked is not None)
    return SimResult(
        log=scheduler.log,
        submitted=arrivals[:i],
        t_end_s=now,
        wall_s=time.perf_counter() - wall0,
        busy_s=busy_s,
        stats=scheduler.stats,
        kv_capacity_tokens=scheduler.kv.capacity_tokens,
        unfinished=unfinished + (n - i),
    )
