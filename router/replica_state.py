"""One router replica's view of the cluster's fairness state, from the workers' reports (pure).

With R router replicas over the same workers, each dispatches only some of the calls. Each
worker keeps a service ledger with one row per (replica, client) — what that replica's
dispatches of that client were charged and served there — and sends it with its ``Load``
(``worker/service_ledger.py``). A row grows only by its own replica's dispatches (a
G-counter), so replica r's view of client c's service on worker u is

    view(u, c) = r's own service of c on u (counted here, exact)
               + every other replica's row (·, c) in u's latest report

stale by at most one report period (plus the network) in its second term, never ahead::

    state.dispatched(u, client, charge)           # own dispatch (charge: extend tokens)
    state.finished(u, client, num_output)         # own Finished received
    peers = state.report(u, t_s, report)          # [(client, extend, output)] the other
                                                  # replicas' service on u since the last report
    state.service(u, client) -> (extend, output)  # the view above
    state.peer_requests(u)                        # the other replicas' requests on u

``report`` returns exactly what this replica had not seen: a router policy that keeps its own
charges (D2LPM's deficits) adds these and then holds the view above. Nothing a worker reports
can make this replica count anything twice: its own row is never read, and another's row is
read as totals. The first snapshot (``ServiceReport.full``) of a worker boot is a baseline —
its rows hold history the policy never charged (a replica that starts late, a worker that
restarted or was forgotten and taken back), so it returns ``[]``. A report that fails a
check changes nothing. ``docs/replicas.md``: the model and what it does to D2LPM's bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_fair.messages import ServiceReport
from sgl_fair.request import ClientId


@dataclass
class _WorkerView:
    own: dict[ClientId, list[int]] = field(default_factory=dict)  # [extend, output]
    boot: int | None = None  # the boot of its baseline snapshot; None: none taken yet
    t_s: float = float("-inf")  # the last report's time (the worker's clock)
    rows: dict[tuple[int, ClientId], tuple[int, int, int]] = field(default_factory=dict)
    # per client: every other replica's row it saw, summed — forgotten rows included, so the
    # view is the client's whole service on the worker however its rows come and go
    peers: dict[ClientId, list[int]] = field(default_factory=dict)
    peer_requests: int = 0  # from the last report


class ReplicaState:
    def __init__(self, replica: int) -> None:
        if replica < 0:
            raise ValueError(f"replica ids are >= 0 (got {replica})")
        self.replica = replica
        self._workers: dict[int, _WorkerView] = {}
        self.num_reports = 0
        self.num_stale_reports = 0
        self.num_baselines = 0
        self.num_refused_reports = 0

    def _view(self, worker: int) -> _WorkerView:
        view = self._workers.get(worker)
        if view is None:
            view = self._workers[worker] = _WorkerView()
        return view

    # ---- own actions ------------------------------------------------------------------------

    def dispatched(self, worker: int, client: ClientId, charge: int) -> None:
        """Record an own dispatch charged ``charge`` extend tokens."""
        if charge < 0:
            raise ValueError(f"charge must be >= 0 (got {charge})")
        self._view(worker).own.setdefault(client, [0, 0])[0] += charge

    def finished(self, worker: int, client: ClientId, num_output: int) -> None:
        """An own request's ``Finished`` from ``worker`` arrived (ok or not)."""
        self._view(worker).own.setdefault(client, [0, 0])[1] += num_output

    # ---- reports ----------------------------------------------------------------------------

    def report(
        self, worker: int, t_s: float, report: ServiceReport
    ) -> list[tuple[ClientId, int, int]]:
        """Take ``worker``'s report; returns the other replicas' service on it since the last
        one, per client: ``(client, extend tokens, output tokens)``, zeros left out. An older
        report than the last one taken is ignored, and so is every report of a boot before
        its first snapshot, which is a baseline (``[]``). A row that went back (the same
        birth, smaller totals) raises ValueError, and nothing of the report is taken."""
        view = self._view(worker)
        if t_s < view.t_s:
            self.num_stale_reports += 1
            return []
        me = self.replica
        if view.boot != report.boot:  # a view to start: only from a snapshot of this boot
            if not report.full:
                return []
            view.boot, view.t_s = report.boot, t_s
            view.rows = {(r, c): (e, o, b) for r, c, e, o, b in report.rows if r != me}
            view.peers = {}
            for (_, c), (e, o, _) in view.rows.items():
                totals = view.peers.setdefault(c, [0, 0])
                totals[0] += e
                totals[1] += o
            self._requests(view, report)
            self.num_reports += 1
            self.num_baselines += 1
            return []
        new: dict[ClientId, list[int]] = {}
        for r, c, e, o, b in report.rows:
            if r == me:
                continue
            e0, o0, b0 = view.rows.get((r, c), (0, 0, b))
            if b0 != b:  # a row forgotten and born again: all of it is new
                e0 = o0 = 0
            if e < e0 or o < o0:
                self.num_refused_reports += 1
                raise ValueError(f"worker {worker}'s row ({r}, {c!r}) went back "
                                 f"({e0}, {o0}) -> ({e}, {o})")  # fmt: skip
            if e > e0 or o > o0:
                delta = new.setdefault(c, [0, 0])
                delta[0] += e - e0
                delta[1] += o - o0
        for r, c, e, o, b in report.rows:
            if r != me:
                view.rows[(r, c)] = (e, o, b)
        if report.full:  # rows not listed were forgotten there (idle): so are they here,
            listed = {(r, c) for r, c, *_ in report.rows}  # their totals stay in the sums
            for key in [k for k in view.rows if k not in listed]:
                del view.rows[key]
        peers: list[tuple[ClientId, int, int]] = []
        for c, (e, o) in sorted(new.items()):
            self._add(view, c, e, o)
            peers.append((c, e, o))
        view.t_s = t_s
        self._requests(view, report)
        self.num_reports += 1
        return peers

    def _requests(self, view: _WorkerView, report: ServiceReport) -> None:
        own_here = dict(report.requests).get(self.replica, 0)
        view.peer_requests = max(0, report.num_requests - own_here)

    @staticmethod
    def _add(view: _WorkerView, client: ClientId, extend: int, output: int) -> None:
        totals = view.peers.setdefault(client, [0, 0])
        totals[0] += extend
        totals[1] += output

    # ---- the view ---------------------------------------------------------------------------

    def service(self, worker: int, client: ClientId) -> tuple[int, int]:
        """Client's (extend, output) tokens on ``worker`` as this replica knows them: its own
        plus the other replicas' rows in the last report."""
        view = self._workers.get(worker)
        if view is None:
            return (0, 0)
        own = view.own.get(client, (0, 0))
        peer = view.peers.get(client, (0, 0))
        return (own[0] + peer[0], own[1] + peer[1])

    def peer_requests(self, worker: int) -> int:
        """The other replicas' requests on ``worker`` (queued or running) at its last report,
        and any no replica tagged."""
        view = self._workers.get(worker)
        return view.peer_requests if view is not None else 0

    def last_report_s(self, worker: int) -> float | None:
        view = self._workers.get(worker)
        return None if view is None or view.t_s == float("-inf") else view.t_s

    def num_rows(self, worker: int) -> int:
        """The other replicas' rows held for ``worker``."""
        view = self._workers.get(worker)
        return len(view.rows) if view is not None else 0

    def has_baseline(self, worker: int) -> bool:
        view = self._workers.get(worker)
        return view is not None and view.boot is not None

    def worker_removed(self, worker: int) -> None:
        """Forget ``worker`` (dead, restarted, or this replica lost it): the policy forgot
        its service with it; the next snapshot of it is a baseline."""
        self._workers.pop(worker, None)
