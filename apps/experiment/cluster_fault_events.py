"""The faults of ``cluster_fault_sim.simulate_faults`` (issue 40), as a mixin of its loop.

``FaultEvents`` uses the loop's state — ``rset`` (the ``FaultReplicaSet``), ``plan``,
``workers``, ``gen``, ``owners``, ``attached``, ``retired``, ``calls``, ``open``,
``received``, ``duplicated``, ``counts``, ``boot_ids`` — and its ``push``, ``_at``, ``_core``,
``_ledger``, ``_submit``, ``_dispatch``, ``_answer`` and ``_fail``. What each fault does is in
``cluster_fault_sim``'s docstring; the live code it follows is named at each step.
"""

from __future__ import annotations

import math
from typing import Any

from sgl_fair import kv_events
from sgl_fair.remote import ATTACH_PERIOD_S

_FAULT, _ATTACH, _HELLO, _UP = range(8, 12)  # after cluster_fault_sim's event kinds


class FaultEvents:
    def _fault_event(self, kind: int, payload: Any, t: float) -> None:
        plan, rset = self.plan, self.rset
        if kind == _FAULT:
            if plan.kind == "worker-restart":
                self._restart_worker(plan.worker, t)
            elif plan.kind == "replica-restart":
                self._restart_replica(plan.replica, t)
            else:
                self._duplicate(t)
                if payload + 1 < plan.count:
                    self.push(t + plan.every_s, _FAULT, payload + 1)
        elif kind == _ATTACH:
            u, replica = payload
            w = self.workers[u]
            slot = rset.slot_of(replica)
            if slot is None or replica in self.attached[u]:
                return
            self.attached[u].add(replica)
            w.ledger.want_full()
            paths = kv_events.cached_paths(w.core.scheduler.kv.tree.root)
            self.push(self._at(slot, u, t), _HELLO, (replica, u, w.ledger.boot, paths, t))
        elif kind == _HELLO:
            replica, u, boot, paths, t_sent = payload
            slot = rset.slot_of(replica)
            if slot is None:
                return
            if rset.is_live(slot, u):  # a Hello on a live link: what u held of ours is gone
                self.counts["worker_deaths_seen"] += 1
                for rid in rset.worker_lost(slot, u):
                    self._lost(slot, replica, rid, u, t)
            rset.worker_joined(slot, u, boot, paths, t_sent)
        else:  # _UP
            new = rset.replica_up(payload)
            for u in range(len(self.workers)):
                self.push(self._at(payload, u, t), _ATTACH, (u, new))

    def _lost(self, slot: int, replica: int, rid: str, u: int, t: float) -> None:
        """Replica ``replica`` lost call ``rid`` with worker ``u``: move it, or fail it."""
        call = self.calls.get((replica, rid))
        if call is None:
            return
        if self.plan.streaming and call.streamed:
            self._fail(call, t, f"worker {u} failed mid-request")
            return
        call.req, call.streamed = call.req.unscheduled_copy(), False
        try:
            self._dispatch(slot, call, t)
        except RuntimeError:
            self._fail(call, t, "no worker alive")
            return
        self.counts["calls_redispatched"] += 1

    def _restart_worker(self, u: int, t: float) -> None:
        w = self.workers[u]
        self.retired.append(w.core)
        w.core = self._core(u)
        w.ledger = self._ledger(u, next(self.boot_ids))
        w.inbox.clear()
        w.busy = w.wake_pending = False
        w.result = None
        self.gen[u] += 1
        self.owners[u], self.attached[u] = {}, set()
        n = len(self.rset.replicas)
        for s in range(n):
            if self.rset.up[s]:  # its next Attach tick (the live link's health check)
                phase = s * ATTACH_PERIOD_S / n
                tick = phase + math.ceil((t - phase) / ATTACH_PERIOD_S) * ATTACH_PERIOD_S
                self.push(self._at(s, u, tick), _ATTACH, (u, self.rset.ids[s]))
        self.counts["worker_restarts"] += 1

    def _restart_replica(self, slot: int, t: float) -> None:
        old = self.rset.replica_down(slot)
        for key, call in list(self.calls.items()):
            if key[0] != old:
                continue
            del self.calls[key]
            if call.kind == "duplicate":  # its client gets a connection error
                self.counts["duplicates_lost_with_replica"] += 1
                self.counts["answered"] += 1
                continue
            del self.open[call.rid]
            self._retry(call, t)
        self.push(t + self.plan.down_s, _UP, slot)

    def _retry(self, call: Any, t: float) -> None:
        """The client's connection dropped: the balancer sends the call again, a new request
        (the router draws a new rid for each), through the next replica."""
        self.counts["calls_retried"] += 1
        retry = call.req.unscheduled_copy()
        retry.rid = f"{call.rid}~retry{self.counts['calls_retried']}"
        self._submit(call.prog, retry, "retry", call.rid, call.index, t)

    def _duplicate(self, t: float) -> None:
        """Send a call on a worker again under its rid, through the next replica."""
        rset = self.rset
        while self.received:
            key = self.received.pop()
            call = self.calls.get(key)
            if call is None or call.kind == "duplicate" or call.rid in self.duplicated:
                continue
            slot = rset.slot_of(call.replica)
            other = None if slot is None else rset.next_ready(slot)
            if other is None or (rset.ids[other], key[1]) in self.calls:
                continue
            self.duplicated.add(call.rid)
            self.counts["duplicates_sent"] += 1
            self._submit(None, call.req.unscheduled_copy(), "duplicate", key[1], -1, t, other)
            return

    def _outcome(self) -> None:
        """The calls' outcomes, from what clients sent and heard (not from the bookkeeping a
        fault could corrupt): hung = sent, never answered; lost = hung and held by no live
        replica (nobody will answer them)."""
        rset = self.rset
        sent = self.counts["calls"] + self.counts["duplicates_sent"]
        hung = sent - self.counts["answered"]
        held = sum(rset.holds(c.replica, c.req.rid) for c in self.calls.values())
        live = [rep for s, rep in enumerate(rset.replicas) if rset.up[s]]
        rset.outcome = {
            "fault": self.plan.kind,
            "fault_at_s": self.plan.at_s,
            "calls_lost": hung - held,
            "calls_hung": hung,
            "inflight_leaked": sum(len(rep.inflight) for rep in live),
            "views_within_ledgers": True,  # checked as the run ended (it raises otherwise)
            **{k: self.counts[k] for k in _COUNTS},
        }


_COUNTS = (
    "calls_failed", "calls_redispatched", "calls_retried", "calls_refused", "duplicates_sent",
    "duplicates_answered", "duplicates_lost_with_replica", "requests_aborted_by_workers",
    "worker_restarts", "worker_deaths_seen",
)  # fmt: skip
