"""The one simulation loop: ``scheduler.step → engine.run → scheduler.apply`` in virtual time.

Time only moves by engine step durations and by jumping to the next arrival when the worker
is idle, so a 10-minute experiment takes seconds of CPU. Arrivals that land during a step
join the queue at the step's end, as they would in a live continuous-batching loop::

    while True:
        arrivals.release(now, scheduler)          # every request due by now joins
        stop at until_s, or when before_step(loop) says so
        batch = scheduler.step(now)               # timed: loop.last_step_wall_s
        if batch is None: jump to arrivals.next_s(), or stop when none is pending
        result = engine.run(batch); now += result.duration_s
        scheduler.apply(result, now)
        on_step(loop, batch, result, start_s); stop when stop(loop) says so

``simulate`` (open-loop requests, ``sim.runner``) and the experiments with closed-loop
workloads (BROS's BE job, FairServe's interactions) and the benches run it with their own
arrival source and hooks; none of them writes the loop again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from sgl_fair.request import Request
from sgl_fair.worker.engine import Batch, Engine, StepResult
from sgl_fair.worker.scheduler import Scheduler


class Arrivals(Protocol):
    """Where requests come from."""

    def release(self, now: float, scheduler: Scheduler) -> None:
        """Add every request due by ``now`` to ``scheduler`` (each at its own arrival time)."""
        ...

    def next_s(self) -> float | None:
        """When the next pending request arrives; None when none is pending (the loop ends
        once the worker is idle)."""
        ...


class NoArrivals:
    """Nothing arrives on its own: the hooks add requests (closed-loop drivers)."""

    def release(self, now: float, scheduler: Scheduler) -> None:
        pass

    def next_s(self) -> float | None:
        return None


class OpenArrivals:
    """Open-loop requests, in arrival order (``Request.arrival_key``)."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = sorted(requests, key=Request.arrival_key)
        self.num_released = 0

    def release(self, now: float, scheduler: Scheduler) -> None:
        reqs, i, n = self.requests, self.num_released, len(self.requests)
        while i < n and reqs[i].arrival_s <= now:
            scheduler.add_request(reqs[i], reqs[i].arrival_s)
            i += 1
        self.num_released = i

    def next_s(self) -> float | None:
        i = self.num_released
        return self.requests[i].arrival_s if i < len(self.requests) else None

    @property
    def released(self) -> list[Request]:
        return self.requests[: self.num_released]

    @property
    def num_pending(self) -> int:
        return len(self.requests) - self.num_released


class SimLoop:
    """One worker's loop in virtual time; ``run`` it once. Its state (``now``,
    ``num_steps``, ``busy_s``, ``step_wall_s``, ``last_step_wall_s``) is what the hooks see.

    ``until_s``: stop once virtual time reaches it (arrivals due by then are released);
    ``before_step(loop) -> bool``: called before each step, False stops the loop;
    ``on_step(loop, batch, result, start_s)``: after each step's ``apply``;
    ``stop(loop) -> bool``: after ``on_step``, True stops the loop;
    ``check_every=k``: ``scheduler.check_invariants()`` every k steps and at the end (tests).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        engine: Engine,
        arrivals: Arrivals | None = None,
        *,
        until_s: float | None = None,
        before_step: Callable[[SimLoop], bool] | None = None,
        on_step: Callable[[SimLoop, Batch, StepResult, float], None] | None = None,
        stop: Callable[[SimLoop], bool] | None = None,
        check_every: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.engine = engine
        self.arrivals = arrivals if arrivals is not None else NoArrivals()
        self.until_s = until_s
        self.before_step = before_step
        self.on_step = on_step
        self.stop = stop
        self.check_every = check_every
        self.now = 0.0
        self.num_steps = 0
        self.busy_s = 0.0  # virtual seconds the engine ran
        self.step_wall_s = 0.0  # wall seconds inside scheduler.step (idle calls included)
        self.last_step_wall_s = 0.0

    def run(self) -> SimLoop:
        sched, engine, arrivals = self.scheduler, self.engine, self.arrivals
        until, before, on_step, stop = self.until_s, self.before_step, self.on_step, self.stop
        check_every = self.check_every
        clock = time.perf_counter
        while True:
            arrivals.release(self.now, sched)
            if until is not None and self.now >= until:
                break
            if before is not None and not before(self):
                break
            t0 = clock()
            batch = sched.step(self.now)
            self.last_step_wall_s = clock() - t0
            self.step_wall_s += self.last_step_wall_s
            if batch is None:
                nxt = arrivals.next_s()
                if nxt is None:
                    break
                self.now = nxt
                continue
            result = engine.run(batch)
            start = self.now
            self.now = start + result.duration_s
            self.busy_s += result.duration_s
            sched.apply(result, self.now)
            self.num_steps += 1
            if check_every and self.num_steps % check_every == 0:
                sched.check_invariants()
            if on_step is not None:
                on_step(self, batch, result, start)
            if stop is not None and stop(self):
                break
        if check_every:
            sched.check_invariants()
        return self
