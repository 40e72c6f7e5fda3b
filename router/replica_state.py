"""One router replica's view of the cluster's fairness state, from the workers' reports (pure).

With R router replicas over the same workers, each replica dispatches only some of the
calls. The workers are the source of truth: each sums, per client, the service every replica
dispatched to it and the output it served (``worker/service_ledger.py``), and sends the totals
with its ``Load`` (``ServiceReport``). A replica's view of client c's service on worker u is

    view(u, c) = the last report's totals(u, c) + its own dispatches and Finished not yet in one

so every replica sees every replica's service, stale by at most one report period (plus the
network). The arithmetic is exact: a report says which of this replica's dispatches it covers
(the replica's last ``seq`` the worker received), and covers every ``Finished`` this replica
has received from that worker (same channel, in order), so nothing is counted twice::

    seq = state.dispatched(u, client, charge)     # own dispatch (charge: extend tokens)
    state.finished(u, client, num_output)         # own Finished received
    peers = state.report(u, t_s, report)          # [(client, extend, output)] the other
                                                  # replicas' service on u since the last report
    state.service(u, client) -> (extend, output)  # the view above
    state.peer_requests(u)                        # the other replicas' requests on u

``report`` returns exactly what this replica had not seen: a router policy that keeps its own
charges (D2LPM's deficits) adds these and then holds the view above. ``docs/replicas.md``:
the model and what it does to D2LPM's bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sgl_fair.messages import ServiceReport
from sgl_fair.request import ClientId


@dataclass
class _WorkerView:
    seq: int = 0  # own dispatches to this worker so far
    t_s: float = float("-inf")  # the last report's time (the worker's clock)
    reported: dict[ClientId, tuple[int, int]] = field(default_factory=dict)
    covered: int = 0  # own dispatches the last report covered (its seq for us)
    pending: deque[tuple[int, ClientId, int]] = field(default_factory=deque)  # seq, c, charge
    unreported_out: dict[ClientId, int] = field(default_factory=dict)  # own Finished since
    own_finished: int = 0  # own Finished received, ever
    peer_requests: int = 0  # from the last report


class ReplicaState:
    def __init__(self, replica: int) -> None:
        if replica < 0:
            raise ValueError(f"replica ids are >= 0 (got {replica})")
        self.replica = replica
        self._workers: dict[int, _WorkerView] = {}
        self._rejoined: set[int] = set()  # workers whose next report is a baseline
        self.num_reports = 0
        self.num_stale_reports = 0

    def _view(self, worker: int) -> _WorkerView:
        view = self._workers.get(worker)
        if view is None:
            view = self._workers[worker] = _WorkerView()
        return view

    # ---- own actions ------------------------------------------------------------------------

    def dispatched(self, worker: int, client: ClientId, charge: int) -> int:
        """Record an own dispatch; returns its ``seq`` (the worker's ledger needs it)."""
        if charge < 0:
            raise ValueError(f"charge must be >= 0 (got {charge})")
        view = self._view(worker)
        view.seq += 1
        view.pending.append((view.seq, client, charge))
        return view.seq

    def finished(self, worker: int, client: ClientId, num_output: int) -> None:
        """An own request's ``Finished`` from ``worker`` arrived (ok or not)."""
        view = self._view(worker)
        view.own_finished += 1
        view.unreported_out[client] = view.unreported_out.get(client, 0) + num_output

    # ---- reports ----------------------------------------------------------------------------

    def report(
        self, worker: int, t_s: float, report: ServiceReport
    ) -> list[tuple[ClientId, int, int]]:
        """Take ``worker``'s report; returns the other replicas' service on it since the last
        one, per client: ``(client, extend tokens, output tokens)``, zeros left out. A report
        older than the last one taken is ignored (``[]``). The first report after
        ``worker_removed`` is a baseline: its totals hold the worker's whole history, which
        the policy forgot with the worker, so it returns ``[]``. Raises ValueError for a report
        that contradicts this replica's own record."""
        view = self._view(worker)
        if t_s < view.t_s:
            self.num_stale_reports += 1
            return []
        seq = dict(report.seqs).get(self.replica, 0)
        if not view.covered <= seq <= view.seq:
            raise ValueError(f"worker {worker} reports seq {seq} for replica {self.replica}, "
                             f"which sent {view.seq} (covered: {view.covered})")  # fmt: skip
        covered: dict[ClientId, int] = {}
        while view.pending and view.pending[0][0] <= seq:
            _, client, charge = view.pending.popleft()
            covered[client] = covered.get(client, 0) + charge
        own_out = view.unreported_out
        new = {c: (a, s) for c, a, s in report.clients}
        peers: list[tuple[ClientId, int, int]] = []
        for client in new.keys() | covered.keys() | own_out.keys():
            a, s = new.get(client, (0, 0))
            a0, s0 = view.reported.get(client, (0, 0))
            extend = a - a0 - covered.get(client, 0)
            output = s - s0 - own_out.get(client, 0)
            if extend < 0 or output < 0:
                raise ValueError(f"worker {worker}'s report undercounts client {client!r} "
                                 f"(extend {extend}, output {output}): not this replica's "
                                 "record")  # fmt: skip
            if extend or output:
                peers.append((client, extend, output))
        own_here = seq - view.own_finished  # own requests on the worker at the report
        if own_here < 0 or report.num_requests < own_here:
            raise ValueError(f"worker {worker} reports {report.num_requests} requests, "
                             f"{own_here} of them this replica's")  # fmt: skip
        view.t_s = t_s
        view.reported = new
        view.covered = seq
        view.unreported_out = {}
        view.peer_requests = report.num_requests - own_here
        self.num_reports += 1
        if worker in self._rejoined:
            self._rejoined.discard(worker)
            return []
        peers.sort()
        return peers

    # ---- the view ---------------------------------------------------------------------------

    def service(self, worker: int, client: ClientId) -> tuple[int, int]:
        """Client's (extend, output) tokens on ``worker`` as this replica knows them: the last
        report's totals plus its own dispatches and Finished not yet in a report."""
        view = self._workers.get(worker)
        if view is None:
            return (0, 0)
        a, s = view.reported.get(client, (0, 0))
        a += sum(charge for _, c, charge in view.pending if c == client)
        return (a, s + view.unreported_out.get(client, 0))

    def peer_requests(self, worker: int) -> int:
        """The other replicas' requests on ``worker`` (queued or running) at its last report."""
        view = self._workers.get(worker)
        return view.peer_requests if view is not None else 0

    def last_report_s(self, worker: int) -> float | None:
        view = self._workers.get(worker)
        return None if view is None or view.t_s == float("-inf") else view.t_s

    def worker_removed(self, worker: int) -> None:
        """Forget ``worker`` (dead, or this replica lost it); its next report is a baseline."""
        if self._workers.pop(worker, None) is not None:
            self._rejoined.add(worker)
