"""Cluster simulation: one router and N simulated workers in one virtual-time loop.

The router (``sgl_fair.router.Router``) and each worker's ``Scheduler`` are the same
objects the live system runs; they talk only through the message types of
``sgl_fair.messages``, delivered after ``net_delay_s`` of virtual time::

    client ──call──▶ router ──Dispatch──▶ worker ┐ steps: scheduler.step → engine.run
       ▲               ▲◀──Tokens/Finished/Evicted/Load──┘       → scheduler.apply
       └─ next calls ──┘  (programs are closed-loop: a call's children are issued when
                           the client hears it finished)

Everything is driven by one heap of timestamped events, so a run is deterministic
given its inputs. A worker that receives a dispatch while idle wakes up at that
instant (after every other event of the same instant, so simultaneous dispatches
form one batch); dispatches that land during a step join the queue at the step's
end, as in a live continuous-batching loop.

The workload is a list of programs (``sgl_fair.workloads.programs.Program``: DAGs of
calls, closed loop) and/or plain open-loop requests.

**Service reports** (``ClusterConfig.report_period_s``; router replicas, ``docs/replicas.md``).
Each worker keeps a ``ServiceLedger`` and sends its totals with a ``Load`` every
``report_period_s``, idle or not (the last such tick ends with the run's other events). A
dispatch is tagged ``(replica, charge)`` by ``take_tag(rid)`` (None for one router); the
tag travels with it, as the live ``Dispatch`` would carry it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from msgspec.structs import replace as _replace_struct

from sgl_fair.messages import Dispatch, Finished, Load
from sgl_fair.policies.base import Policy, Rejection
from sgl_fair.records import RequestRecord, ServiceEvent
from sgl_fair.request import Phase, Request
from sgl_fair.worker.engine import StepResult
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from sgl_fair.worker.service import WorkerCore
from sgl_fair.worker.service_ledger import ServiceLedger
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker


class ProgramLike(Protocol):
    """What the driver needs of a program (``sgl_fair.workloads.programs.Program``)."""

    program_id: str
    client: str
    start_s: float

    def start(self, now: float) -> list[Request]: ...

    def on_finished(self, req: Request, now: float) -> list[Request]: ...

    def on_failed(self, req: Request, now: float) -> None: ...

    @property
    def done(self) -> bool: ...


class RouterLike(Protocol):
    """What the simulator drives: ``router.Router`` and the experiments' replica set."""

    def throttle(self, req: Request, now: float) -> Rejection | None:
        """Asked first for each arriving call (the cluster OIT; None when it is off): a refused
        call is recorded rejected and never reaches a worker."""
        ...

    def dispatch(self, req: Request, now: float) -> Dispatch: ...

    def take_tag(self, rid: str) -> tuple[int, int] | None:
        """The ``(replica, charge)`` the dispatch of ``rid`` carries to its worker (router
        replicas); None for a single router."""
        ...

    def handle(self, msg: Any, now: float) -> None: ...

    def check_invariants(self) -> None: ...


@dataclass(frozen=True)
class ClusterConfig:
    dp: int = 4
    gpu: str = "A100-80GB"
    model: str = "Llama-3.1-8B"
    tp: int | None = None
    kv_tokens: int | None = None  # per worker; default: what the GPU's memory holds
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    net_delay_s: float = 0.0005  # one way, router <-> worker
    load_interval_s: float = 0.1  # how often a worker reports Load
    # Workers keep a service ledger and report it with a Load this often (None: no ledger).
    report_period_s: float | None = None

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1 (got {self.dp})")
        if self.net_delay_s < 0:
            raise ValueError(f"net_delay_s must be >= 0 (got {self.net_delay_s})")
        if self.load_interval_s <= 0:
            raise ValueError(f"load_interval_s must be > 0 (got {self.load_interval_s})")
        if self.report_period_s is not None and not self.report_period_s > 0:
            raise ValueError(f"report_period_s must be > 0 (got {self.report_period_s})")


@dataclass
class SimWorker:
    """A simulated worker: its ``WorkerCore`` (scheduler + engine) and delivery state."""

    core: WorkerCore
    busy: bool = False
    wake_pending: bool = False
    inbox: list[tuple[Request, float]] = field(default_factory=list)
    result: StepResult | None = None
    num_dispatched: int = 0
    ledger: ServiceLedger | None = None

    @property
    def wid(self) -> int:
        return self.core.wid

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def engine(self) -> Any:
        return self.core.engine

    @property
    def busy_s(self) -> float:
        return self.core.busy_s


@dataclass
class ClusterResult:
    workers: list[SimWorker]
    submitted: list[Request]  # every call that reached the router (refused ones too), in order
    programs: list[Any]
    t_end_s: float
    wall_s: float
    router: Any
    unfinished: int  # calls dispatched but not finished when the run stopped
    unissued_programs: int  # programs that never started (run stopped first)

    @property
    def events(self) -> list[ServiceEvent]:
        return [ev for w in self.workers for ev in w.scheduler.log.events]

    def records(self) -> list[RequestRecord]:
        return [RequestRecord.from_request(r) for r in self.submitted]

    @property
    def stats(self) -> list[SchedulerStats]:
        return [w.scheduler.stats for w in self.workers]

    @property
    def busy_s(self) -> list[float]:
        return [w.busy_s for w in self.workers]

    @property
    def speedup(self) -> float:
        return self.t_end_s / self.wall_s if self.wall_s > 0 else float("inf")

    def dispatch_counts(self) -> list[int]:
        return [w.num_dispatched for w in self.workers]


# Event kinds; events at one instant run in the order they were scheduled.
_START, _CALL, _TO_WORKER, _TO_ROUTER, _STEP_DONE, _WAKE, _REPORT, _REPORT_IN = range(8)


def simulate_cluster(
    *,
    router: RouterLike,
    local_policy: Callable[[int], Policy],
    config: ClusterConfig,
    programs: Sequence[ProgramLike] = (),
    requests: Sequence[Request] = (),
    until_s: float | None = None,
    check_every: int = 0,
    cost_model: CostModel | None = None,
) -> ClusterResult:
    """Run ``programs`` (closed loop) and ``requests`` (open loop) through the cluster.

    Stops when nothing is left to do, or at virtual time ``until_s``. ``local_policy(w)``
    builds worker ``w``'s policy. ``check_every=k`` checks every scheduler's and the
    router's invariants every k events (tests).
    """
    cost_model = cost_model or CostModel.from_names(config.gpu, config.model, tp=config.tp)
    workers: list[SimWorker] = []
    period = config.report_period_s
    for wid in range(config.dp):
        sched, engine = make_sim_worker(
            policy=local_policy(wid),
            cost_model=cost_model,
            kv_tokens=config.kv_tokens,
            config=config.scheduler,
        )
        interval = config.load_interval_s if period is None else period
        core = WorkerCore(wid, sched, engine, load_interval_s=interval)
        ledger = None if period is None else ServiceLedger(boot=wid + 1)
        workers.append(SimWorker(core, ledger=ledger))
    delay = config.net_delay_s
    heap: list[tuple[float, int, int, Any]] = []
    seq = itertools.count()

    def push(t: float, kind: int, payload: Any) -> None:
        heapq.heappush(heap, (t, next(seq), kind, payload))

    for prog in programs:
        push(prog.start_s, _START, prog)
    for req in requests:
        push(req.arrival_s, _CALL, (None, req))

    throttle, take_tag = router.throttle, router.take_tag
    ticks = 0  # report ticks and the reports they sent, in the heap
    if period is not None:
        for w in workers:
            push(period, _REPORT, w)
            ticks += 1
    t_last = 0.0  # the last event's time, report ticks aside
    owner: dict[str, Any] = {}  # rid -> program (None for open-loop requests)
    calls: dict[str, Request] = {}  # rid -> request, while in flight
    submitted: list[Request] = []
    wall0 = time.perf_counter()
    now = 0.0
    num_events = 0
    started_programs = 0

    def issue(prog: Any, new_calls: Iterable[Request], t: float) -> None:
        for call in new_calls:
            push(max(call.arrival_s, t), _CALL, (prog, call))

    def report(w: SimWorker, t: float) -> None:
        """Send what the worker's last step (or arrivals) produced to the router."""
        for msg in w.core.drain(t).messages:
            if w.ledger is not None:
                msg = _with_ledger(w.ledger, msg)
            push(t + delay, _TO_ROUTER, msg)

    def run_step(w: SimWorker, t: float) -> None:
        rejected = False
        for req, t_in in w.inbox:
            rejected |= not w.core.add(req, t_in)
        w.inbox.clear()
        if rejected:
            report(w, t)  # answer refusals now, not after the next step
        w.result = w.core.step(t)
        if w.result is None:
            w.busy = False
            return
        w.busy = True
        push(t + w.result.duration_s, _STEP_DONE, w)

    while heap:
        t, _, kind, payload = heap[0]
        if until_s is not None and t > until_s:
            now = until_s
            break
        heapq.heappop(heap)
        now = t
        if kind == _REPORT:  # a worker's periodic report (its Load, with its ledger)
            w = payload
            # This tick leaves the heap, its report enters it: ``ticks`` is unchanged.
            push(t + delay, _REPORT_IN, _replace_load(w.core.load(t), w.ledger))
            if len(heap) > ticks:  # other events remain: keep reporting
                push(t + period, _REPORT, w)
                ticks += 1
            continue
        if kind == _REPORT_IN:  # ... reaches the router
            ticks -= 1
            router.handle(payload, t)
            continue
        t_last = t
        if kind == _STEP_DONE:
            w = payload
            result, w.result = w.result, None
            w.core.complete(result, t)
            report(w, t)
            run_step(w, t)
        elif kind == _TO_ROUTER:
            router.handle(payload, t)
            if isinstance(payload, Finished):
                req = calls.pop(payload.rid, None)
                prog = owner.pop(payload.rid, None)
                if req is not None and prog is not None:
                    if payload.ok:
                        issue(prog, prog.on_finished(req, t), t)
                    else:
                        prog.on_failed(req, t)
        elif kind == _TO_WORKER:
            dispatch, tag = payload
            w = workers[dispatch.worker]
            if w.ledger is not None and tag is not None:
                replica, charge = tag
                w.ledger.received(dispatch.req.rid, replica, dispatch.req.client, charge)
            w.inbox.append((dispatch.req, t))
            w.num_dispatched += 1
            if not w.busy and not w.wake_pending:
                w.wake_pending = True
                push(t, _WAKE, w)
        elif kind == _WAKE:
            w = payload
            w.wake_pending = False
            if not w.busy:
                run_step(w, t)
        elif kind == _CALL:
            prog, req = payload
            submitted.append(req)
            rejection = throttle(req, t)
            if rejection is not None:  # the router's cluster OIT refused it: never sent
                _refuse(req, rejection)
                if prog is not None:
                    prog.on_failed(req, t)
            else:
                owner[req.rid] = prog
                calls[req.rid] = req
                dispatch = router.dispatch(req, t)
                tag = take_tag(req.rid)
                push(t + delay, _TO_WORKER, (dispatch, tag))
        else:  # _START
            started_programs += 1
            issue(payload, payload.start(t), t)
        num_events += 1
        if check_every and num_events % check_every == 0:
            _check(workers, router)
    else:
        now = t_last
    if check_every:
        _check(workers, router)
    return ClusterResult(
        workers=workers,
        submitted=submitted,
        programs=list(programs),
        t_end_s=now,
        wall_s=time.perf_counter() - wall0,
        router=router,
        unfinished=len(calls),
        unissued_programs=len(programs) - started_programs,
    )


def _with_ledger(ledger: ServiceLedger, msg: Any) -> Any:
    """Account a ``Finished`` as sent; put the ledger's totals on a ``Load``."""
    if isinstance(msg, Finished):
        ledger.sent(msg.rid, msg.num_output)
    elif isinstance(msg, Load):
        return _replace_load(msg, ledger)
    return msg


def _replace_load(load: Load, ledger: ServiceLedger | None) -> Load:
    return load if ledger is None else _replace_struct(load, service=ledger.report())


def _refuse(req: Request, rejection: Rejection) -> None:
    """Record a router refusal on ``req`` as a worker's scheduler records its own."""
    req.phase = Phase.REJECTED  # no finish_s: as the scheduler leaves its own refusals
    req.reject_reason = rejection.reason
    req.reject_retry_after_s = rejection.retry_after_s
    if rejection.limit is not None:
        req.reject_limit = (
            rejection.limit, rejection.limit_max or 0, rejection.limit_window_s or 0.0,
        )  # fmt: skip


def _check(workers: Sequence[SimWorker], router: RouterLike) -> None:
    for w in workers:
        w.scheduler.check_invariants()
    router.check_invariants()
