"""A router replica: the ``Router`` plus the workers' service reports (issue 34).

R replicas dispatch over the same workers. Each is a ``Router`` (its own global tree, its own
policy state, its own requests in flight) that, with ``shared=True``, also reads the
``ServiceReport`` on every worker's ``Load`` (``router/replica_state.py``):

* the policy's per-(worker, client) service — D2LPM's deficits — gets the other replicas'
  service as the reports bring it (the policy's ``on_peer_service`` hook, a capability: a
  policy without it keeps only its own dispatches);
* ``queue_len(u)`` counts the other replicas' requests on u at its last report beside this
  replica's own (dispatched − finished, exact), so least-queued choices and D2LPM's load guard
  see the whole queue;
* the cluster OIT learns the interactions under way on u (``ServiceReport.interactions``),
  so a call of an interaction another replica started is never refused here.

``shared=False`` is an independent replica: today's router behind a load balancer, with its
own dispatches only. With one replica and ``shared=True`` the reports add nothing, so it
decides exactly as a plain ``Router``.

Each dispatch is tagged for the worker's ledger: the ``Dispatch``'s own ``tag`` =
``(replica, charge)`` (also ``last_tag`` after ``dispatch``), which a standalone worker reads
off the wire and a bridge sends to its SGLang server's plugin, whose ledger ``/server_info``
reports (``worker/sglang/ledger.py``).
The charge is the prompt's extend on the chosen worker by this replica's tree
(``input_len − matched_len_on_u``, D2LPM's dispatch charge before weights).
"""

from __future__ import annotations

from typing import Any

import msgspec

from sgl_fair.messages import Dispatch, Evicted, Finished, Load, Tokens
from sgl_fair.request import Request
from sgl_fair.router.policies.base import PeerServiceAware, RouterPolicy
from sgl_fair.router.replica_state import ReplicaState
from sgl_fair.router.router import Router


class ReplicaRouter(Router):
    def __init__(
        self,
        policy: RouterPolicy,
        num_workers: int,
        *,
        replica: int = 0,
        shared: bool = True,
        **router_options: Any,
    ) -> None:
        super().__init__(policy, num_workers, **router_options)
        self.replica = replica
        self.shared = shared
        self.state = ReplicaState(replica)
        self.last_tag: tuple[int, int] | None = None
        self._report_seen: dict[int, float] = {}  # worker -> when (router clock) last taken
        self._on_peer_service = (
            policy.on_peer_service if isinstance(policy, PeerServiceAware) else None
        )

    def queue_len(self, worker: int) -> int:
        own = super().queue_len(worker)
        if not self.shared or worker not in self.workers:
            return own
        if not self.state.has_baseline(worker):  # no service report from it yet (or ever: an
            load = self.load(worker)  # SGLang server whose ledger its bridge cannot read):
            return own if load is None else max(own, load.num_waiting + load.num_running)
        return own + self.state.peer_requests(worker)  # every router's, from its Load

    def dispatch(self, req: Request, now: float) -> Dispatch:
        match = self.tree.match(req.input_ids, touch=False) if self.shared else None
        dispatch = super().dispatch(req, now)
        if match is not None:
            charge = req.input_len - match.per_worker.get(dispatch.worker, 0)
            self.state.dispatched(dispatch.worker, req.client, charge)
            self.last_tag = (self.replica, charge)
            dispatch = msgspec.structs.replace(dispatch, tag=self.last_tag)
        return dispatch

    def handle(self, msg: Tokens | Finished | Evicted | Load, now: float) -> None:
        if self.shared and isinstance(msg, Finished):
            entry = self.inflight.get(msg.rid)
            if entry is not None and entry[0] == msg.worker and msg.worker in self.workers:
                self.state.finished(msg.worker, msg.client, msg.num_output)
        super().handle(msg, now)
        if self.shared and isinstance(msg, Load) and msg.service is not None:
            if msg.worker not in self.workers:
                return
            peers = self.state.report(msg.worker, msg.t_s, msg.service)
            self._report_seen[msg.worker] = now
            if self.oit is not None and msg.service.interactions:
                self.oit.under_way(msg.service.interactions, now)
            if self._on_peer_service is not None:
                for client, extend, output in peers:
                    self._on_peer_service(msg.worker, client, extend, output, self)

    def report_seen(self, worker: int) -> float | None:
        """When (the router's clock) this replica last took ``worker``'s service report."""
        return self._report_seen.get(worker)

    def remove_worker(self, worker: int) -> list[str]:
        self.state.worker_removed(worker)
        self._report_seen.pop(worker, None)
        return super().remove_worker(worker)

    def add_worker(self, worker: int) -> None:
        if worker not in self.workers:
            self.state.worker_removed(worker)  # a rejoined worker's totals start again
        super().add_worker(worker)
