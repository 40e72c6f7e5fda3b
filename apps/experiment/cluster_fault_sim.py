"""The cluster simulator with a fault injected into router replicas mid-run (issue 40).

``simulate_faults`` runs what ``worker/sim/cluster.py``'s ``simulate_cluster`` runs — the
same workers, the same events in the same order, the same report ticks; with nothing
injected it reproduces that run exactly (``tests/apps/test_cluster_replica_faults.py``) —
but every message travels on the link between one worker and one replica process, as in
the live system (``worker/remote.py``, ``router/remote_link.py``, ``router/liveness.py``):

* **A worker** knows the replicas that spoke to it (``attached``) and which replica sent each
  request (``owners``): Tokens and Finished go to that replica, Load and Evicted to every
  replica it knows, KV events to every replica. A rid already here is refused at once
  (``Finished(REJECTED)``), its charge counted in the sender's ledger row
  (``ServiceLedger.refused``). A send to a replica process that is gone fails, and the
  worker forgets that replica: aborts its requests (``RemoteWorker.forget``).
* **A worker restart** (same pid): queue, running requests, prefix cache and ledger are gone;
  the new process (a new boot id) knows no replica. A replica's next dispatch there, or its
  next ``Attach`` (every ``ATTACH_PERIOD_S``), makes the worker say ``Hello`` (with an
  ``Attach``: and its cache, ``KVSnapshot``, and a full report next); a ``Hello`` on a live
  link is a death, then a rejoin: the replica's calls there are re-dispatched elsewhere, or
  failed if a token reached the client; the first snapshot of the new boot is a baseline.
* **A partition** delays everything between one replica and one worker until it heals.
* **A replica restart**: the clients of its calls lose their connection and the balancer
  sends each call again, as a new request (a new rid, as the router draws one per request),
  through the next replica (``calls_retried``); the workers abort the dead replica's requests
  at their next send to it; the new process gets a new id and no state, and enters the
  balancer once every worker said Hello.
* **Duplicate rids**: a call on a worker is sent again under its rid through the next
  replica; its answer goes to that second client only (``calls_refused`` when refused).

A call's outcome is counted where its client hears it: ``calls_failed`` (the fault failed
it), ``calls_redispatched``, ``calls_retried``, ``calls_refused``; ``calls_hung`` are calls
still open at the end, ``calls_lost`` those of them no replica holds any more (nobody will
answer them), ``inflight_leaked`` the calls a live replica still holds at the end. Every run
ends with every scheduler's and replica's invariants checked (``views_within_ledgers``: no
replica's view of a client on a worker above what the workers' ledgers hold).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.messages import Finished, FinishReason, Load, Tokens
from sgl_fair.policies.base import Policy
from sgl_fair.records import ServiceEvent
from sgl_fair.request import Phase, Request
from sgl_fair.worker.scheduler import SchedulerStats
from sgl_fair.worker.service import WorkerCore
from sgl_fair.worker.sim.cluster import (
    ClusterConfig,
    ClusterResult,
    ProgramLike,
    SimWorker,
    _check,
    _refuse,
    _replace_load,
)
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker

from .cluster_fault_events import _FAULT, _HELLO, FaultEvents
from .cluster_replica_faults import CountingLedger, FaultReplicaSet

_START, _CALL, _TO_WORKER, _TO_ROUTER, _STEP_DONE, _WAKE, _REPORT, _REPORT_IN = range(8)


@dataclass
class _Call:
    """A call as its client sees it: sent through replica ``replica`` (an id)."""

    req: Request  # what its replica last dispatched
    prog: Any
    kind: str  # "call" | "retry" | "duplicate"
    rid: str  # the program's rid (a retry's request has another)
    replica: int
    index: int  # in ``submitted`` (-1: a duplicate)
    worker: int | None = None
    streamed: bool = False


@dataclass
class FaultClusterResult(ClusterResult):
    retired: list[WorkerCore] = field(default_factory=list)  # cores of restarted workers

    @property
    def events(self) -> list[ServiceEvent]:  # the service every process gave, dead ones' too
        return super().events + [ev for c in self.retired for ev in c.scheduler.log.events]

    @property
    def stats(self) -> list[SchedulerStats]:
        return super().stats + [c.scheduler.stats for c in self.retired]

    @property
    def busy_s(self) -> list[float]:
        busy = super().busy_s
        for c in self.retired:
            busy[c.wid] += c.busy_s
        return busy


def simulate_faults(
    *,
    router: FaultReplicaSet,
    local_policy: Callable[[int], Policy],
    config: ClusterConfig,
    programs: Sequence[ProgramLike] = (),
    until_s: float | None = None,
    check_every: int = 0,
    cost_model: CostModel | None = None,
) -> FaultClusterResult:
    """``simulate_cluster`` for ``router``'s replicas with its ``plan`` injected (same
    arguments; programs only). The outcome counts land in ``router.outcome`` (its stats)."""
    if config.report_period_s is None:
        raise ValueError("a fault run needs the workers' service reports (report_period_s)")
    cost_model = cost_model or CostModel.from_names(config.gpu, config.model, tp=config.tp)
    return _FaultSim(router, local_policy, config, cost_model).run(programs, until_s, check_every)


class _FaultSim(FaultEvents):
    def __init__(
        self,
        rset: FaultReplicaSet,
        local_policy: Callable[[int], Policy],
        config: ClusterConfig,
        cost_model: CostModel,
    ) -> None:
        self.rset, self.plan, self.config = rset, rset.plan, config
        self.local_policy, self.cost_model = local_policy, cost_model
        self.delay = config.net_delay_s
        self.period: float = config.report_period_s  # type: ignore[assignment]
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.ticks = 0
        self.workers: list[SimWorker] = []
        self.gen: list[int] = []
        self.owners: list[dict[str, int]] = []  # per worker: rid -> the replica that sent it
        self.attached: list[set[int]] = []  # per worker: the replica ids it knows
        self.undrained: set[int] = set()  # workers with aborts not yet drained
        self.retired: list[WorkerCore] = []
        self.calls: dict[tuple[int, str], _Call] = {}  # (replica id, request rid) -> call
        self.open: dict[str, _Call] = {}  # program rid -> its call (a retry's included)
        self.submitted: list[Request] = []
        self.received: list[tuple[int, str]] = []  # calls as workers took them (duplicates)
        self.duplicated: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.boot_ids = itertools.count(config.dp + 1)  # boots 1..dp: the first processes
        for wid in range(config.dp):
            self.workers.append(SimWorker(self._core(wid), ledger=self._ledger(wid, wid + 1)))
            self.gen.append(0)
            self.owners.append({})
            self.attached.append(set(rset.ids))

    def _core(self, wid: int) -> WorkerCore:
        sched, engine = make_sim_worker(
            policy=self.local_policy(wid), cost_model=self.cost_model,
            kv_tokens=self.config.kv_tokens, config=self.config.scheduler,
        )  # fmt: skip
        return WorkerCore(wid, sched, engine, load_interval_s=self.period)

    def _ledger(self, wid: int, boot: int) -> CountingLedger:
        ledger = CountingLedger(boot=boot)
        self.rset.worker_boot(wid, boot, ledger.totals)
        return ledger

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def _at(self, slot: int | None, worker: int, t: float) -> float:
        """When a message sent at ``t`` between replica ``slot`` and ``worker`` arrives."""
        heal = None if slot is None else self.plan.cut(slot, worker, t)
        return t + self.delay if heal is None else heal + self.delay

    # ---- the loop (simulate_cluster's, event for event) -------------------------------------

    def run(
        self, programs: Sequence[ProgramLike], until_s: float | None, check_every: int
    ) -> FaultClusterResult:
        heap, rset, period = self.heap, self.rset, self.period
        for prog in programs:
            self.push(prog.start_s, _START, prog)
        for w in self.workers:
            self.push(period, _REPORT, w)
            self.ticks += 1
        if self.plan.kind != "partition":  # a partition is a time window, no event
            self.push(self.plan.at_s, _FAULT, 0)
        wall0, now, t_last, num_events, started = time.perf_counter(), 0.0, 0.0, 0, 0
        t = 0.0
        while heap:
            t, _, kind, payload = heap[0]
            if until_s is not None and t > until_s:
                now = until_s
                break
            heapq.heappop(heap)
            now = t
            if kind == _REPORT:
                w = payload
                self._fan_out(w, _replace_load(w.core.load(t), w.ledger), t, tick=True)
                if len(heap) > self.ticks:
                    self.push(t + period, _REPORT, w)
                    self.ticks += 1
                continue
            if kind == _REPORT_IN:
                self.ticks -= 1
                rset.deliver_load(*payload, t)
                continue
            t_last = t
            if kind == _STEP_DONE:
                w, gen = payload
                if gen == self.gen[w.wid]:
                    result, w.result = w.result, None
                    w.core.complete(result, t)
                    self._report(w, t)
                    self._run_step(w, t)
            elif kind == _TO_ROUTER:
                self._to_router(payload, t)
            elif kind == _TO_WORKER:
                self._to_worker(*payload, t)
            elif kind == _WAKE:
                w, gen = payload
                if gen == self.gen[w.wid]:
                    w.wake_pending = False
                    if not w.busy:
                        self._run_step(w, t)
            elif kind == _CALL:
                prog, req = payload
                self.submitted.append(req)
                self.counts["calls"] += 1
                self._submit(prog, req, "call", req.rid, len(self.submitted) - 1, t)
            elif kind == _START:
                started += 1
                self._issue(payload, payload.start(t), t)
            else:
                self._fault_event(kind, payload, t)
            num_events += 1
            if check_every and num_events % check_every == 0:
                _check(self.workers, rset)
        else:
            now = t_last
        _check(self.workers, rset)  # always at the end: no view above the ledgers' truth
        self._outcome()
        return FaultClusterResult(
            workers=self.workers, submitted=self.submitted, programs=list(programs),
            t_end_s=now, wall_s=time.perf_counter() - wall0, router=rset,
            unfinished=len(self.open), unissued_programs=len(programs) - started,
            retired=self.retired,
        )  # fmt: skip

    def _issue(self, prog: Any, new_calls: Sequence[Request], t: float) -> None:
        for call in new_calls:
            self.push(max(call.arrival_s, t), _CALL, (prog, call))

    def _run_step(self, w: SimWorker, t: float) -> None:
        rejected = False
        for req, t_in in w.inbox:
            rejected |= not w.core.add(req, t_in)
        w.inbox.clear()
        if rejected:
            self._report(w, t)
        w.result = w.core.step(t)
        if w.result is None:
            w.busy = False
            if w.wid in self.undrained:  # what it aborted for a gone replica: out now
                self.undrained.discard(w.wid)
                self._report(w, t)
            return
        w.busy = True
        self.push(t + w.result.duration_s, _STEP_DONE, (w, self.gen[w.wid]))

    # ---- worker -> replicas -----------------------------------------------------------------

    def _report(self, w: SimWorker, t: float) -> None:
        """Send what the worker's last step (or arrivals) produced, each to whom it goes."""
        for msg in w.core.drain(t).messages:
            if isinstance(msg, Finished):
                w.ledger.sent(msg.rid, msg.num_output)
                self._send_finished(w, msg, self.owners[w.wid].pop(msg.rid, None), t)
            elif isinstance(msg, Tokens):
                self._send_tokens(w, msg, t)
            else:  # Load, Evicted: every replica it knows
                if isinstance(msg, Load):
                    msg = _replace_load(msg, w.ledger)
                self._fan_out(w, msg, t)

    def _alive(self, w: SimWorker, replica: int | None, t: float) -> int | None:
        """``replica`` if its process still runs; else the send fails: the worker forgets it."""
        if replica is None or self.rset.slot_of(replica) is not None:
            return replica
        self._forget(w, replica, t)
        return None

    def _split(self, u: int, slots: Sequence[int], t: float) -> dict[float, list[int]]:
        out: dict[float, list[int]] = {}
        for s in slots:
            out.setdefault(self._at(s, u, t), []).append(s)
        return out

    def _fan_out(self, w: SimWorker, msg: Any, t: float, *, tick: bool = False) -> None:
        ids = [i for i in sorted(self.attached[w.wid]) if self._alive(w, i, t) is not None]
        slots = sorted(self.rset.slot_of(i) for i in ids)  # type: ignore[type-var]
        times = self._split(w.wid, slots, t) if slots else {}
        for due, group in sorted(times.items()):
            ids = [self.rset.ids[s] for s in group]
            if tick:
                self.push(due, _REPORT_IN, (ids, msg))
            else:
                self.push(due, _TO_ROUTER, ("load", (ids, msg)))
        if tick:  # this tick left the heap, its reports entered it
            self.ticks += len(times) - 1

    def _send_tokens(self, w: SimWorker, msg: Tokens, t: float) -> None:
        by_id: dict[int, list] = {}
        for item in msg.items:
            owner = self.owners[w.wid].get(item[0])
            if owner is not None:
                by_id.setdefault(owner, []).append(item)
        for owner in [o for o in by_id if self._alive(w, o, t) is None]:
            del by_id[owner]
        groups: dict[float, dict[int, list]] = {t + self.delay: {}}
        for owner, items in by_id.items():
            groups.setdefault(self._at(self.rset.slot_of(owner), w.wid, t), {})[owner] = items
        for due, part in sorted(groups.items()):
            if part or due == t + self.delay:
                self.push(due, _TO_ROUTER, ("tokens", (msg, part)))

    def _send_finished(self, w: SimWorker, msg: Finished, owner: int | None, t: float) -> None:
        owner = self._alive(w, owner, t)
        own_slot = None if owner is None else self.rset.slot_of(owner)
        peers = [s for s in range(len(self.rset.replicas)) if s != own_slot and self.rset.up[s]]
        times = self._split(w.wid, peers, t)
        owner_due = t + self.delay if own_slot is None else self._at(own_slot, w.wid, t)
        times.setdefault(owner_due, [])
        for due, group in sorted(times.items()):
            to = owner if due == owner_due else None
            self.push(due, _TO_ROUTER, ("finished", (msg, to, tuple(group))))

    def _to_router(self, payload: tuple[str, Any], t: float) -> None:
        what, args = payload
        if what == "load":
            self.rset.deliver_load(*args, t)
        elif what == "tokens":
            msg, by_id = args
            self.rset.deliver_tokens(msg, by_id, t)
            for replica, items in by_id.items():
                for rid, _ in items:
                    call = self.calls.get((replica, rid))
                    if call is not None and call.worker == msg.worker:
                        call.streamed = True
        else:
            msg, owner, kv_slots = args
            if self.rset.deliver_finished(msg, owner, kv_slots, t):
                call = self.calls.get((owner, msg.rid))
                if call is not None:
                    self._answer(call, msg.ok, t, refused=msg.reason is FinishReason.REJECTED)

    def _forget(self, w: SimWorker, replica: int, t: float) -> None:
        """The worker's send to a gone replica failed: abort what that replica sent it."""
        u = w.wid
        self.attached[u].discard(replica)
        rids = {rid for rid, p in self.owners[u].items() if p == replica}
        for rid in rids:
            del self.owners[u][rid]
            w.core.abort(rid, t, f"router {replica} left")
        queued = [(r, t_in) for r, t_in in w.inbox if r.rid in rids]
        for req, _ in queued:  # never added: closed here and now
            w.ledger.sent(req.rid, 0)
        w.inbox = [x for x in w.inbox if x[0].rid not in rids]
        self.counts["requests_aborted_by_workers"] += len(rids)
        if rids:
            self.undrained.add(u)

    # ---- replicas -> worker -----------------------------------------------------------------

    def _submit(self, prog: Any, req: Request, kind: str, rid: str, index: int, t: float,
                slot: int | None = None) -> None:  # fmt: skip
        rset = self.rset
        slot = rset.pick() if slot is None else slot
        if slot is None:
            raise RuntimeError("no replica takes calls")
        rejection = rset.throttle_at(slot, req, t)
        if rejection is not None:  # the router's cluster OIT refused it: never sent
            self.counts["answered"] += 1
            _refuse(req, rejection)
            if prog is not None:
                prog.on_failed(_as(req, rid), t)
            return
        call = _Call(req, prog, kind, rid, rset.ids[slot], index)
        if kind != "duplicate":
            self.open[rid] = call
        self.calls[(call.replica, req.rid)] = call
        self._dispatch(slot, call, t)

    def _dispatch(self, slot: int, call: _Call, t: float) -> None:
        dispatch, tag = self.rset.dispatch_at(slot, call.req, t)
        call.worker = u = dispatch.worker
        if tag is not None:
            key = (call.replica, u, call.req.client)
            self.rset.transit[key] = self.rset.transit.get(key, 0) + tag[1]
        self.push(self._at(slot, u, t), _TO_WORKER, (dispatch, tag, call.replica))

    def _to_worker(self, dispatch: Any, tag: Any, sender: int, t: float) -> None:
        u, req = dispatch.worker, dispatch.req
        w = self.workers[u]
        if tag is not None:
            self.rset.transit[(sender, u, req.client)] -= tag[1]
        slot = self.rset.slot_of(sender)
        if slot is None:  # its replica died with it unsent
            return
        if sender not in self.attached[u]:  # it spoke first (we restarted): say who we are
            self.attached[u].add(sender)
            self.push(self._at(slot, u, t), _HELLO, (sender, u, w.ledger.boot, [], t))
        if req.rid in self.owners[u] or req.rid in w.core.requests:  # refused, charge counted
            if tag is not None:
                w.ledger.refused(tag[0], req.client, tag[1])
            why = "request id already in flight on this worker"
            refusal = Finished(
                u,
                t,
                req.rid,
                req.client,
                FinishReason.REJECTED,
                tuple(req.input_ids),
                (),
                error=why,
            )
            self.push(self._at(slot, u, t), _TO_ROUTER, ("finished", (refusal, sender, ())))
            return
        self.owners[u][req.rid] = sender
        if tag is not None:
            w.ledger.received(req.rid, tag[0], req.client, tag[1])
        self.received.append((sender, req.rid))
        w.inbox.append((req, t))
        w.num_dispatched += 1
        if not w.busy and not w.wake_pending:
            w.wake_pending = True
            self.push(t, _WAKE, (w, self.gen[u]))

    # ---- answers ----------------------------------------------------------------------------

    def _answer(self, call: _Call, ok: bool, t: float, *, refused: bool = False) -> None:
        del self.calls[(call.replica, call.req.rid)]
        self.counts["answered"] += 1
        if call.kind == "duplicate":
            self.counts["calls_refused" if refused else "duplicates_answered"] += 1
            return
        del self.open[call.rid]
        req = _as(call.req, call.rid)
        self.submitted[call.index] = req
        if call.prog is not None:
            if ok:
                self._issue(call.prog, call.prog.on_finished(req, t), t)
            else:
                call.prog.on_failed(req, t)

    def _fail(self, call: _Call, t: float, why: str) -> None:
        req = call.req
        if req.finish_s is None:
            req.phase, req.abort_reason, req.finish_s = Phase.ABORTED, why, t
        self.counts["calls_failed"] += 1
        self._answer(call, False, t)


def _as(req: Request, rid: str) -> Request:
    """``req`` under the program's ``rid`` (a retry travelled under another)."""
    return req if req.rid == rid else dataclasses.replace(req, rid=rid)
