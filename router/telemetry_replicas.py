"""The replica layer on ``/metrics`` (issue 40, item 6), read at scrape time: nothing is
counted on the hot path twice.

Per router (``sgl_fair_replica_*``; a plain router reports zeros):

* ``reports_total``, ``reports_stale_total``, ``reports_refused_total``,
  ``reports_baseline_total``: workers' service reports taken, ignored as older than the last,
  refused (a row that went back: nothing taken) and taken as a baseline (the first snapshot
  of a worker boot, charged to nobody);
* ``rows{worker}``: the other replicas' (replica, client) rows this replica holds per worker;
* ``view_age_seconds{worker}``: how old the last report taken from each worker is, on this
  router's clock — the staleness of the second term of ``docs/replicas.md``'s view, which
  the bound's ``τ = p + 2δ`` assumes stays near one report period;
* ``peer_requests{worker}``: the other replicas' requests on each worker at its last report.

Membership (``router/membership.py``, once the server runs): ``sgl_fair_workers{state}``
(starting, ready, draining, dead), ``sgl_fair_workers_added_total`` and
``sgl_fair_workers_removed_total``; with Kubernetes discovery ``sgl_fair_discovery_lists_total``
and ``sgl_fair_discovery_failures_total`` (pod lists read, and not read: the workers then stay
as they are).

Per worker, for every router: ``sgl_fair_worker_kv_event_gaps_total{worker}`` — KV-event
batches the router never received (a gap in the publisher's sequence numbers) and could not
replay: each leaves the global tree missing what the lost events stored or removed, until
the next events of those pages; ``sgl_fair_worker_kv_event_replayed_total{worker}`` — the
missed batches it replayed from the publisher's buffer (``router/kv_replay.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class ReplicaCollector:
    """Registered with the server's registry from the start (``Telemetry``): its metrics are
    listed, without samples, until ``watch`` gives it the router service to read."""

    def __init__(self, service: Any = None) -> None:
        self.service = service
        self.membership: Any = None  # set once the server runs (apps/launch/serve.py)

    def watch(self, service: Any) -> None:
        self.service = service

    def describe(self) -> list:
        return []  # collected at scrape time only (no names registered up front)

    def collect(self) -> Iterator[Any]:
        p = "sgl_fair_replica_"
        service = self.service
        router = service.router if service is not None else None
        state = getattr(router, "state", None)  # a ReplicaRouter's; None for a plain Router
        counts = {  # name: (the ReplicaState count, help)
            "reports": ("num_reports", "Workers' service reports taken"),
            "reports_stale": ("num_stale_reports", "Reports ignored: older than the last"),
            "reports_refused": ("num_refused_reports", "Reports refused: a row went back"),
            "reports_baseline": ("num_baselines", "Reports taken as a worker boot's baseline"),
        }
        for name, (attr, doc) in counts.items():
            c = CounterMetricFamily(p + name, doc)
            c.add_metric([], getattr(state, attr, 0) if state is not None else 0)
            yield c
        rows = GaugeMetricFamily(p + "rows", "Other replicas' service rows held", labels=["worker"])
        age = GaugeMetricFamily(
            p + "view_age_seconds", "Age of the last service report taken", labels=["worker"]
        )
        peers = GaugeMetricFamily(
            p + "peer_requests", "Other replicas' requests at the last report", labels=["worker"]
        )
        gaps = CounterMetricFamily(
            "sgl_fair_worker_kv_event_gaps", "KV-event batches lost (not replayed)",
            labels=["worker"],
        )  # fmt: skip
        replayed = CounterMetricFamily(
            "sgl_fair_worker_kv_event_replayed", "KV-event batches missed, then replayed",
            labels=["worker"],
        )  # fmt: skip
        workers = service.workers if service is not None else {}
        now = service.clock() if service is not None else 0.0  # the router's report clock
        for wid, w in sorted(workers.items()):
            label = [str(wid)]
            gaps.add_metric(label, w.kv_gaps)
            replayed.add_metric(label, w.kv_replayed)
            if state is None:
                continue
            rows.add_metric(label, state.num_rows(wid))
            peers.add_metric(label, state.peer_requests(wid))
            seen = router.report_seen(wid)
            if seen is not None:
                age.add_metric(label, max(0.0, now - seen))
        yield from (rows, age, peers, gaps, replayed)
        yield from self._membership()

    def _membership(self) -> Iterator[Any]:
        """Zeros until the server runs (and without discovery), as the replica counts are."""
        m = self.membership
        states = GaugeMetricFamily("sgl_fair_workers", "Workers by membership state",
                                   labels=["state"])  # fmt: skip
        counts = dict.fromkeys(("starting", "ready", "draining", "dead"), 0)
        for wid in m.members if m is not None else ():
            counts[m.state(wid)] = counts.get(m.state(wid), 0) + 1
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        d = m.discovery if m is not None else None
        for name, value, doc in (
            ("sgl_fair_workers_added", m.num_added if m else 0, "Workers added at run time"),
            ("sgl_fair_workers_removed", m.num_removed if m else 0, "Workers removed at run time"),
            ("sgl_fair_discovery_lists", d.num_lists if d else 0, "Pod lists read (Kubernetes)"),
            ("sgl_fair_discovery_failures", d.num_failures if d else 0, "Pod lists not read"),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
