"""One simulated worker (``make_sim_worker``) and open-loop requests through it in virtual
time (``simulate``, on the one simulation loop: ``sim.loop``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import Policy
from sgl_fair.records import RequestRecord
from sgl_fair.request import Request
from sgl_fair.worker.builder import build_worker
from sgl_fair.worker.engine import Engine
from sgl_fair.worker.scheduler import RunLog, Scheduler, SchedulerConfig, SchedulerStats
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine
from sgl_fair.worker.sim.loop import OpenArrivals, SimLoop
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
    """A scheduler + simulated engine pair (``worker.builder.build_worker`` with the ``sim``
    engine); the KV pool is derived from memory unless given. ``allocator``: the KV
    allocator's registry name (``sgl_fair.worker.kv.allocator_names``) with its
    ``allocator_opts``."""
    scheduler, engine = build_worker(
        policy=policy,
        engine="sim",
        engine_opts={"token_range": token_range, "text": text, "eos_token_id": eos_token_id},
        cost_model=cost_model,
        kv_tokens=kv_tokens,
        allocator=allocator,
        allocator_opts=allocator_opts,
        config=config,
    )
    assert isinstance(engine, SimEngine)
    return scheduler, engine


def simulate(
    requests: Sequence[Request],
    *,
    scheduler: Scheduler,
    engine: Engine,
    until_s: float | None = None,
    check_every: int = 0,
) -> SimResult:
    """Run ``requests`` through one worker until all finish (or virtual time ``until_s``):
    the simulation loop (``sim.loop.SimLoop``) over open-loop arrivals.

    ``check_every=k`` calls ``scheduler.check_invariants()`` every k steps (tests).
    """
    arrivals = OpenArrivals(requests)
    wall0 = time.perf_counter()
    loop = SimLoop(scheduler, engine, arrivals, until_s=until_s, check_every=check_every).run()
    unfinished = len(scheduler.waiting) + len(scheduler.running) + (scheduler.chunked is not None)
    return SimResult(
        log=scheduler.log,
        submitted=arrivals.released,
        t_end_s=loop.now,
        wall_s=time.perf_counter() - wall0,
        busy_s=loop.busy_s,
        stats=scheduler.stats,
        kv_capacity_tokens=scheduler.kv.capacity_tokens,
        unfinished=unfinished + arrivals.num_pending,
    )
