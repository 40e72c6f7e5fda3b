"""Router replicas with a fault injected mid-run (issue 40): the plan and the replicas' side.

``FaultPlan`` names one fault of ``d2lpm-replicas``' fault rows (``FAULTS``):

* ``worker-restart`` — worker ``worker`` restarts at ``at_s`` with the same pid: its queue,
  running requests, prefix cache and service ledger are gone (a new boot id);
* ``partition`` — replica ``replica`` and worker ``worker`` cannot reach each other for
  ``duration_s`` (7 s): what either sends the other meanwhile arrives when it heals (TCP
  buffers it; the worker's peer timeout, 15 s, and the router's heartbeat timeout, 10 s, are
  both longer, so neither side declares the other gone);
* ``replica-restart`` — replica ``replica`` dies at ``at_s``; its process starts again
  ``down_s`` later with a new replica id (ids are drawn per process) and empty state;
* ``duplicate-rid`` — from ``at_s``, ``count`` times every ``every_s``, a call already on a
  worker is sent again under its rid through another replica.

``FaultReplicaSet`` is ``ReplicaSet`` (``cluster_replica_set.py``: the balancer, the
replicas, what their staleness is measured in) with the replicas' side of the live system's
fault handling (``router/liveness.py``, ``router/remote_link.py``), driven message by
message and replica by replica by ``cluster_fault_sim.simulate_faults``:

* ``worker_lost`` — a ``Hello`` on a live link (the worker lost this replica's state): the
  replica removes the worker (``ReplicaRouter.remove_worker`` forgets its tree, deficits
  and view of it) and hands back the calls it had there, which the driver re-dispatches
  (no token reached the client) or fails; ``worker_joined`` takes the worker back, with the
  cache it reported (``KVSnapshot``); its next snapshot is a baseline;
* ``replica_down`` / ``replica_up`` — a slot's process dies; a new one with a new id and no
  state takes its place, attaches to every worker and enters the balancer once each said
  Hello;
* KV events from a worker reach a replica cut off from it when the partition heals.

The truth a view is checked against (``check_invariants``) comes from the workers' ledgers
(``CountingLedger``s; ``ledgers``: every row's totals per worker boot, forgotten rows
included): a replica's view
of client c on worker u never exceeds the other replicas' rows of the boot its view follows
plus its own rows in that and later boots and its dispatches still on the way. ``view lag``
is ``ReplicaSet``'s (the dispatch-time truth minus the view), except that a view created
mid-run (a worker taken back, a new replica) counts from its baseline snapshot: the history
before it, which it is told not to charge, is not lag; views that start with the run are
measured exactly as ``ReplicaSet`` measures them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgl_fair.kv_decoder import Stored
from sgl_fair.messages import Dispatch, Evicted, Finished, Load, Tokens
from sgl_fair.policies.base import Rejection
from sgl_fair.request import Request
from sgl_fair.router.policies.base import RouterPolicy
from sgl_fair.router.replica import ReplicaRouter
from sgl_fair.worker.service_ledger import ServiceLedger

from .cluster_replica_set import ReplicaSet

FAULTS = ("worker-restart", "partition", "replica-restart", "duplicate-rid")

# per (worker, boot): client -> replica -> [extend, output], every row's totals for good
Ledgers = dict[tuple[int, int], dict[str, dict[int, list[int]]]]


class CountingLedger(ServiceLedger):
    """A ``ServiceLedger`` that also keeps every row's totals for good (idle rows it forgets
    included): ``totals[client][replica] = [extend, output]``, the truth views are held to."""

    def __init__(self, *, boot: int) -> None:
        super().__init__(boot=boot)
        self.totals: dict[str, dict[int, list[int]]] = {}
        self._of: dict[str, tuple[int, str]] = {}

    def _add(self, replica: int, client: str, extend: int, output: int) -> None:
        row = self.totals.setdefault(client, {}).setdefault(replica, [0, 0])
        row[0] += extend
        row[1] += output

    def received(
        self, rid: str, replica: int, client: str, charge: int, *, interaction: str | None = None
    ) -> None:
        super().received(rid, replica, client, charge, interaction=interaction)
        self._of[rid] = (replica, client)
        self._add(replica, client, charge, 0)

    def refused(self, replica: int, client: str, charge: int) -> None:
        super().refused(replica, client, charge)
        self._add(replica, client, charge, 0)

    def sent(self, rid: str, num_output: int) -> None:
        super().sent(rid, num_output)
        of = self._of.pop(rid, None)
        if of is not None:
            self._add(of[0], of[1], 0, num_output)


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    at_s: float
    worker: int = 1
    replica: int = 1  # the balancer's slot
    duration_s: float = 7.0  # partition
    down_s: float = 1.0  # replica-restart: until the new process starts
    count: int = 20  # duplicate-rid: duplicates sent ...
    every_s: float = 0.25  # ... this far apart
    # Calls stream their tokens: one whose tokens reached its client cannot move to another
    # worker when its worker is lost (``Call.started`` in the live router): it fails.
    streaming: bool = True

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"unknown fault {self.kind!r} (one of {', '.join(FAULTS)})")
        if self.at_s < 0 or self.duration_s <= 0 or self.down_s < 0 or self.every_s <= 0:
            raise ValueError(f"bad fault times: {self}")
        if self.count < 1 or self.worker < 0 or self.replica < 0:
            raise ValueError(f"bad fault plan: {self}")

    def cut(self, slot: int, worker: int, t: float) -> float | None:
        """When the partition between replica ``slot`` and ``worker`` heals, if ``t`` falls
        in it; None otherwise."""
        if (
            self.kind == "partition"
            and slot == self.replica
            and worker == self.worker
            and self.at_s <= t < self.at_s + self.duration_s
        ):
            return self.at_s + self.duration_s
        return None


def fault_plan(kind: str, duration_s: float, dp: int, replicas: int) -> FaultPlan:
    """``d2lpm-replicas``' fault ``kind`` for a run of ``duration_s`` of arrivals: halfway
    through, on worker 1 and the balancer's second replica."""
    return FaultPlan(kind, duration_s / 2, worker=1 % dp, replica=1 % replicas)


class FaultReplicaSet(ReplicaSet):
    def __init__(
        self,
        make_policy: Callable[[], RouterPolicy],
        num_workers: int,
        replicas: int,
        *,
        plan: FaultPlan,
        kv_event_delay_s: float = 0.001,
        net_delay_s: float = 0.0005,
    ) -> None:
        super().__init__(
            make_policy, num_workers, replicas, shared=True, kv_event_delay_s=kv_event_delay_s
        )
        if plan.worker >= num_workers or plan.replica >= replicas:
            raise ValueError(f"{plan} names a worker or replica this cluster lacks")
        self.plan = plan
        self.make_policy = make_policy
        self.num_workers = num_workers
        self.net_delay_s = net_delay_s
        self.ids = list(range(replicas))  # each slot's process's replica id
        self._slot = {i: i for i in range(replicas)}  # live replica id -> slot
        self._next_id = replicas
        self.up = [True] * replicas  # its process runs
        self.ready = [True] * replicas  # ... and the balancer sends it calls
        self.retired: list[ReplicaRouter] = []
        self.known_boot: list[dict[int, int]] = [{} for _ in range(replicas)]
        self.view_boot: list[dict[int, int]] = [{} for _ in range(replicas)]
        # per slot, per worker whose view the lag is measured for: client -> what it was not
        # to count (service units; none for views that start with the run)
        self._gap: list[dict[int, dict[str, float]]] = [
            {u: {} for u in range(num_workers)} for _ in range(replicas)
        ]
        self.ledgers: Ledgers = {}
        self.boots: dict[int, list[int]] = {}
        self.transit: dict[tuple[int, int, str], int] = {}  # (id, worker, client) -> charges
        self._late: list[tuple[float, int, tuple[int, ...], int, tuple[int, ...]]] = []
        self._late_seq = itertools.count()
        self.outcome: dict[str, Any] = {}  # the driver's counts, for the row

    # ---- who is who -------------------------------------------------------------------------

    def slot_of(self, replica_id: int) -> int | None:
        return self._slot.get(replica_id)

    def pick(self) -> int | None:
        """The balancer: round robin over the replicas that take calls."""
        n = len(self.replicas)
        for _ in range(n):
            s = self._next
            self._next = (s + 1) % n
            if self.ready[s]:
                return s
        return None

    def next_ready(self, slot: int) -> int | None:
        """The first replica after ``slot`` (not it) the balancer sends calls to."""
        n = len(self.replicas)
        for k in range(1, n):
            s = (slot + k) % n
            if self.ready[s]:
                return s
        return None

    def holds(self, replica_id: int, rid: str) -> bool:
        s = self.slot_of(replica_id)
        return s is not None and rid in self.replicas[s].inflight

    def worker_boot(self, worker: int, boot: int, totals: dict) -> None:
        """Worker ``worker``'s process ``boot`` started with a ledger whose totals are
        ``totals``; at the run's start every replica knows it."""
        self.ledgers[(worker, boot)] = totals
        first = worker not in self.boots
        self.boots.setdefault(worker, []).append(boot)
        if first:
            for known in self.known_boot:
                known[worker] = boot

    # ---- calls ------------------------------------------------------------------------------

    def throttle_at(self, slot: int, req: Request, now: float) -> Rejection | None:
        self._owner[req.rid] = slot
        return super().throttle(req, now)

    def dispatch_at(self, slot: int, req: Request, now: float) -> tuple[Dispatch, Any]:
        """Replica ``slot`` dispatches ``req``: the Dispatch and its tag. Raises RuntimeError
        when the replica has no worker."""
        self._owner[req.rid] = slot
        try:
            dispatch = super().dispatch(req, now)
        finally:
            self._owner.pop(req.rid, None)
        u = dispatch.worker
        heal = self.plan.cut(slot, u, now)
        if heal is not None and len(self.replicas) > 1:  # u publishes it once it has it
            _, r, _, path = self._feed.pop()
            self._hold(heal + 2 * self.net_delay_s, self._peers(r), u, path)
        return dispatch, self.take_tag(req.rid)

    # ---- worker messages, replica by replica ------------------------------------------------

    def deliver_load(self, replica_ids: list[int], msg: Load | Evicted, now: float) -> None:
        self._deliver(now)
        for rid_ in replica_ids:
            s = self.slot_of(rid_)
            if s is None:
                continue
            rep = self.replicas[s]
            taken = rep.state.num_reports
            rep.handle(msg, now)
            service = msg.service if isinstance(msg, Load) else None
            if service is not None and rep.state.num_reports > taken:
                known = self.known_boot[s].get(msg.worker)
                assert known == service.boot, f"replica {rid_} took boot {service.boot} " \
                    f"of worker {msg.worker} before its Hello (knows {known})"  # fmt: skip
                if rep.state.has_baseline(msg.worker):
                    self.view_boot[s][msg.worker] = service.boot
                    if msg.worker not in self._gap[s]:  # a view created mid-run: its baseline
                        self._gap[s][msg.worker] = self._unseen(s, msg.worker)

    def deliver_tokens(self, msg: Tokens, by_id: dict[int, list], now: float) -> None:
        self._deliver(now)
        slots = sorted(
            (s, items) for i, items in by_id.items() if (s := self.slot_of(i)) is not None
        )
        for s, items in slots:
            self.replicas[s].handle(Tokens(msg.worker, msg.t_s, tuple(items)), now)

    def deliver_finished(
        self, msg: Finished, owner: int | None, kv_slots: tuple[int, ...], now: float
    ) -> bool:
        """``msg`` reaches its replica ``owner`` (None: not this time), and as a KV event the
        replicas ``kv_slots``; True when it answers a call that replica has on that worker."""
        self._deliver(now)
        own = False
        s = None if owner is None else self.slot_of(owner)
        if s is not None:
            rep = self.replicas[s]
            entry = rep.inflight.get(msg.rid)
            own = entry is not None and entry[0] == msg.worker and msg.worker in rep.workers
            rep.handle(msg, now)
            if own:
                self._account(s, msg.worker, msg.client, 0, msg.num_output)
        if msg.ok:
            path = msg.input_ids + msg.output_ids
            for i in kv_slots:
                if self.up[i] and msg.worker in self.replicas[i].workers:
                    self.replicas[i].apply_kv_ops(msg.worker, [Stored(path)], msg.t_s)
        return own

    # ---- membership -------------------------------------------------------------------------

    def is_live(self, slot: int, worker: int) -> bool:
        return worker in self.known_boot[slot] and worker in self.replicas[slot].workers

    def worker_lost(self, slot: int, worker: int) -> list[str]:
        """Replica ``slot`` declares ``worker`` dead: the rids it had there (to re-dispatch
        or fail, before the worker is taken back)."""
        lost = self.replicas[slot].remove_worker(worker)
        own = self._own[slot]
        for key in [k for k in own if k[0] == worker]:
            del own[key]
        self.view_boot[slot].pop(worker, None)
        self._gap[slot].pop(worker, None)
        self.known_boot[slot].pop(worker, None)
        return lost

    def worker_joined(
        self, slot: int, worker: int, boot: int, paths: list[tuple[int, ...]], t_s: float
    ) -> None:
        rep = self.replicas[slot]
        rep.add_worker(worker)
        self.known_boot[slot][worker] = boot
        if paths:
            rep.apply_kv_ops(worker, [Stored(p) for p in paths], t_s)
        if self.up[slot] and not self.ready[slot]:
            self.ready[slot] = len(self.known_boot[slot]) == self.num_workers

    def replica_down(self, slot: int) -> int:
        """Slot ``slot``'s process dies: its id (no message reaches it any more)."""
        old = self.ids[slot]
        del self._slot[old]
        self.up[slot] = self.ready[slot] = False
        self.retired.append(self.replicas[slot])
        return old

    def replica_up(self, slot: int) -> int:
        """A new process in ``slot``: a new id, empty state, no worker until each says Hello."""
        new = self._next_id
        self._next_id += 1
        rep = ReplicaRouter(self.make_policy(), self.num_workers, replica=new, shared=True)
        for u in range(self.num_workers):
            rep.remove_worker(u)
        self.replicas[slot] = rep
        self.ids[slot] = new
        self._slot[new] = slot
        self.up[slot] = True
        self._own[slot] = {}
        self.known_boot[slot] = {}
        self.view_boot[slot] = {}
        self._gap[slot] = {}
        return new

    # ---- KV events --------------------------------------------------------------------------

    def _peers(self, slot: int) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.replicas)) if i != slot)

    def _hold(self, due: float, slots: tuple[int, ...], u: int, path: tuple[int, ...]) -> None:
        heapq.heappush(self._late, (due, next(self._late_seq), slots, u, path))

    def _deliver(self, now: float) -> None:
        """As ``ReplicaSet._deliver``, except that a replica cut off from the publishing
        worker gets the event when the partition heals."""
        feed = self._feed
        while feed and feed[0][0] <= now:
            due, r, u, path = feed.popleft()
            self._publish(due, self._peers(r), u, path)
        late = self._late
        while late and late[0][0] <= now:
            due, _, slots, u, path = heapq.heappop(late)
            self._publish(due, slots, u, path)

    def _publish(self, t: float, slots: tuple[int, ...], u: int, path: tuple[int, ...]) -> None:
        for i in slots:
            heal = self.plan.cut(i, u, t)
            if heal is not None:
                self._hold(heal + self.net_delay_s, (i,), u, path)
            elif self.up[i] and u in self.replicas[i].workers:
                self.replicas[i].apply_kv_ops(u, [Stored(path)], t)

    # ---- the truth, from the workers' ledgers -----------------------------------------------

    def _ledger_truth(self, slot: int, u: int, client: str) -> tuple[int, int, int, int] | None:
        """(peers' extend, peers' output, own extend, own output) the ledgers hold for the
        view of ``client`` on ``u`` replica ``slot`` keeps; None before its baseline."""
        boot = self.view_boot[slot].get(u)
        if boot is None:
            return None
        me = self.ids[slot]
        pe = po = 0
        for rr, (e, o) in self.ledgers[(u, boot)].get(client, {}).items():
            if rr != me:
                pe += e
                po += o
        oe, oo = self.transit.get((me, u, client), 0), 0
        boots = self.boots[u]
        for b in boots[boots.index(boot) :]:
            e, o = self.ledgers[(u, b)].get(client, {}).get(me, (0, 0))
            oe += e
            oo += o
        return pe, po, oe, oo

    def _unseen(self, r: int, u: int) -> dict[str, float]:
        """Per client, the service on ``u`` replica ``r``'s view does not hold now."""
        return {c: t - self._seen(r, u, c) for (w, c), t in self._truth.items() if w == u}

    def _measure_lag(self, r: int, client: str) -> None:
        lag = 0.0
        gaps = self._gap[r]
        for u in self.replicas[r].workers:
            gap = gaps.get(u)
            if gap is not None:  # none between a view's reset and its baseline
                unseen = self._truth.get((u, client), 0.0) - self._seen(r, u, client)
                lag = max(lag, unseen - gap.get(client, 0.0))
        self.lag_max = max(self.lag_max, lag)
        self.lag_sum += lag
        self.num_dispatches += 1

    def _measure_spread(self, client: str) -> None:  # over every worker, dead or alive
        values = [self._truth.get((u, client), 0.0) for u in range(self.num_workers)]
        self.spread_max = max(self.spread_max, max(values) - min(values))

    def check_invariants(self) -> None:
        """Every live replica's own invariants, and its view of every client on every worker
        within the ledgers' truth: never ahead of it (nothing counted twice), never short of
        its own dispatches."""
        for s, rep in enumerate(self.replicas):
            if not self.up[s]:
                continue
            rep.check_invariants()
            for u in self.view_boot[s]:
                clients = set(self.ledgers[(u, self.view_boot[s][u])])
                clients |= {c for (w, c) in self._own[s] if w == u}
                for c in clients:
                    truth = self._ledger_truth(s, u, c)
                    assert truth is not None
                    ext, out = rep.state.service(u, c)
                    pe, po, oe, oo = truth
                    assert ext <= pe + oe and out <= po + oo, (
                        f"replica {self.ids[s]} counts ({ext}, {out}) of {c!r} on worker {u}: "
                        f"more than the ledgers hold ({pe + oe}, {po + oo})"
                    )
                    own = self._own[s].get((u, c), (0, 0))
                    assert ext >= own[0] and out >= own[1], f"replica {s} lost its own {(u, c)}"

    # ---- statistics -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["num_reports"] += sum(rep.state.num_reports for rep in self.retired)
        out.update(self.outcome)
        return out
