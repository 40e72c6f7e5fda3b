"""Prometheus metrics of the live router (``GET /metrics``).

Per tenant: requests by outcome, input / cached / output tokens, service (the fairness
currency: extend tokens + ``output_weight`` × output tokens, as the schedulers count it),
rejections by reason, TTFT and end-to-end latency histograms, requests by service class
(RT / BE) and FairServe throttles by app, limit and where (a worker or the router). Per
tenant and app, FairServe's measures (``telemetry_interactions.py``): throughput, TTFT,
waiting-queue delay, interactions throttled, tokens wasted, users served / queued /
throttled. Per worker: the router's queue length and the worker's own gauges from its
``Load`` reports, and whether it is alive.
One registry per server, so tests can run several in one process.

Bounded label cardinality: without API keys a tenant is the client id a caller sends (a
header), so anyone could mint label values. At most ``max_tenant_labels`` (1,000) distinct
``tenant`` values get a label of their own, first come first served; later ones are counted
under ``tenant="other"``. The tenants of a tenants file always get their own (they are
registered first and do not count against the cap). ``app`` values are capped the same way
(``MAX_APP_LABELS``, 64).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from sgl_fair.messages import Load
from sgl_fair.router.telemetry_interactions import InteractionMetrics
from sgl_fair.router.telemetry_replicas import ReplicaCollector

MAX_APP_LABELS = 64  # distinct `app` label values of the throttling counter
MAX_TENANT_LABELS = 1_000  # distinct `tenant` label values beyond a tenants file's tenants
OTHER = "other"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class Telemetry:
    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        *,
        output_weight: float = 2.0,
        max_tenant_labels: int = MAX_TENANT_LABELS,
        tenants: Iterable[str] = (),
    ) -> None:
        self.output_weight = output_weight
        self.max_tenant_labels = max_tenant_labels
        self._named_tenants = frozenset(tenants)  # a tenants file's: always labelled
        self._tenants: set[str] = set()
        self._load_gauges: dict[int, tuple[Any, ...]] = {}  # worker -> its Load's gauges
        r = self.registry = CollectorRegistry()
        # process_cpu_seconds_total & co.: the router's own core (its bridges run on it)
        ProcessCollector(registry=r)
        p = "sgl_fair_"
        self.requests = Counter(
            p + "tenant_requests", "Requests by tenant and outcome", ["tenant", "outcome"],
            registry=r,
        )  # fmt: skip
        self.input_tokens = Counter(
            p + "tenant_input_tokens", "Prompt tokens", ["tenant"], registry=r
        )
        self.cached_tokens = Counter(
            p + "tenant_cached_tokens", "Prompt tokens served from a prefix cache", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.output_tokens = Counter(
            p + "tenant_output_tokens", "Generated tokens", ["tenant"], registry=r
        )
        self.service = Counter(
            p + "tenant_service",
            "Service received: uncached prompt tokens + output_weight x output tokens",
            ["tenant"],
            registry=r,
        )
        self.rejections = Counter(
            p + "tenant_rejections", "Requests refused", ["tenant", "reason"], registry=r
        )
        self.by_class = Counter(
            p + "requests_by_class",
            "Requests submitted to a worker, by tenant and service class (rt: real-time, "
            "be: best-effort)",
            ["tenant", "priority_class"],
            registry=r,
        )
        self.throttled_total = Counter(
            p + "requests_throttled",
            "Requests throttled by FairServe's OIT (HTTP 429), by tenant, app, the limit "
            "they were over (user or app) and where (worker: a worker's own OIT; router: "
            "the cluster OIT)",
            ["tenant", "app", "limit", "where"],
            registry=r,
        )
        self._apps: set[str] = set()
        self.ttft = Histogram(
            p + "ttft_seconds", "Time to first token", ["tenant"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            p + "e2e_latency_seconds", "End-to-end request latency", ["tenant"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.cache_hit_rate = Gauge(
            p + "cache_hit_rate", "Cached / prompt tokens over all finished requests", registry=r
        )
        self.queue_len = Gauge(
            p + "worker_queue_length", "Requests dispatched and not finished", ["worker"],
            registry=r,
        )  # fmt: skip
        self.waiting = Gauge(p + "worker_waiting", "Waiting requests", ["worker"], registry=r)
        self.running = Gauge(p + "worker_running", "Running requests", ["worker"], registry=r)
        self.kv_used = Gauge(
            p + "worker_kv_used_tokens", "KV tokens held by running requests", ["worker"],
            registry=r,
        )  # fmt: skip
        self.kv_cached = Gauge(
            p + "worker_kv_cached_tokens", "Evictable prefix-cache tokens", ["worker"], registry=r
        )
        self.kv_usage = Gauge(
            p + "worker_kv_usage", "Used + cached KV tokens / capacity", ["worker"], registry=r
        )
        self.retractions = Gauge(
            p + "worker_retractions",
            "Requests retracted (preempted, to recompute) since the worker started",
            ["worker"],
            registry=r,
        )
        self.alive = Gauge(
            p + "worker_alive", "1 while the worker is alive", ["worker"], registry=r
        )
        self.restarts = Counter(
            p + "worker_restarts",
            "Worker processes restarted after they exited",
            ["worker"],
            registry=r,
        )
        self.queue_full_total = Counter(
            p + "requests_refused_queue_full",
            "Generation requests refused with 429 because --max-queued-requests were queued",
            registry=r,
        )
        self.queued = Gauge(
            p + "requests_queued",
            "Generation requests being served (admitted, not answered)",
            registry=r,
        )
        self.tree_tokens = Gauge(
            p + "router_tree_tokens",
            "Tokens in the router's global radix tree (capped by max_tree_tokens)",
            registry=r,
        )
        self._max_lag_s = 0.0
        self.loop_lag_max_s = Gauge(
            p + "router_loop_lag_max_seconds",
            "The longest the router's event loop was late to its watchdog since start",
            registry=r,
        )
        self.loop_lag_s = Gauge(
            p + "router_loop_lag_seconds",
            "How late the router's event loop ran its last watchdog tick",
            registry=r,
        )
        self._prompt = 0
        self._cached = 0
        # the replica layer and the KV-event feed, read from the router service at scrape
        self.replicas = ReplicaCollector()
        r.register(self.replicas)
        # FairServe's measures by tenant and app (users, interactions, queueing)
        self.interactions = InteractionMetrics(
            r, _LATENCY_BUCKETS, self.app_label, prefix=p, tenant_label=self.tenant_label
        )

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as a label value: its own for a tenants file's tenants and the first
        ``max_tenant_labels`` others, ``"other"`` past them (bounded label cardinality)."""
        if tenant in self._named_tenants or tenant in self._tenants:
            return tenant
        if len(self._tenants) >= self.max_tenant_labels:
            return OTHER
        self._tenants.add(tenant)
        return tenant

    def finished(
        self,
        tenant: str,
        *,
        outcome: str,
        input_len: int,
        cached: int,
        output_len: int,
        ttft_s: float | None,
        e2e_s: float | None,
    ) -> None:
        tenant = self.tenant_label(tenant)
        self.requests.labels(tenant, outcome).inc()
        self.input_tokens.labels(tenant).inc(input_len)
        self.cached_tokens.labels(tenant).inc(cached)
        self.output_tokens.labels(tenant).inc(output_len)
        self.service.labels(tenant).inc(
            max(input_len - cached, 0) + self.output_weight * output_len
        )
        if ttft_s is not None:
            self.ttft.labels(tenant).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.labels(tenant).observe(e2e_s)
        self._prompt += input_len
        self._cached += cached
        if self._prompt:
            self.cache_hit_rate.set(self._cached / self._prompt)

    def submitted(self, tenant: str, priority_class: str) -> None:
        self.by_class.labels(self.tenant_label(tenant), priority_class).inc()

    def app_label(self, app: str | None) -> str:
        """``app`` as a label value. Apps come from clients: past ``MAX_APP_LABELS`` distinct
        apps the rest are counted as ``"other"`` (bounded label cardinality)."""
        app = app or ""
        if app not in self._apps:
            if len(self._apps) >= MAX_APP_LABELS:
                return "other"
            self._apps.add(app)
        return app

    def throttled(self, tenant: str, app: str | None, limit: str, where: str = "worker") -> None:
        """A request throttled by a worker's OIT or the router's (``where``)."""
        label = self.tenant_label(tenant)
        self.throttled_total.labels(label, self.app_label(app), limit, where).inc()

    def rejected(self, tenant: str, reason: str) -> None:
        tenant = self.tenant_label(tenant)
        self.rejections.labels(tenant, reason).inc()
        self.requests.labels(tenant, "rejected").inc()

    def load(self, msg: Load, queue_len: int) -> None:
        gauges = self._load_gauges.get(msg.worker)
        if gauges is None:  # each worker's labelled gauges, looked up once (10 Loads/s each)
            w = str(msg.worker)
            gauges = self._load_gauges[msg.worker] = tuple(
                g.labels(w) for g in (self.queue_len, self.waiting, self.running, self.kv_used,
                                      self.kv_cached, self.kv_usage, self.retractions)
            )  # fmt: skip
        q, waiting, running, used, cached, usage, retractions = gauges
        q.set(queue_len)
        waiting.set(msg.num_waiting)
        running.set(msg.num_running)
        used.set(msg.kv_used_tokens)
        cached.set(msg.kv_cached_tokens)
        cap = msg.kv_capacity_tokens
        usage.set((msg.kv_used_tokens + msg.kv_cached_tokens) / cap if cap else 0)
        retractions.set(msg.num_retractions)

    def worker_alive(self, worker: int, alive: bool) -> None:
        self.alive.labels(str(worker)).set(1 if alive else 0)

    def queue_full(self) -> None:
        self.queue_full_total.inc()

    def track_intake(self, intake: Any) -> None:
        """Export the intake middleware's queue (``intake.py``)."""
        self.queued.set_function(lambda: intake.num_active)

    def watch_tree(self, tree: object) -> None:
        """Export the global tree's size (read at scrape time)."""
        self.tree_tokens.set_function(lambda: tree.total_tokens)

    def worker_restarted(self, worker: int) -> None:
        self.restarts.labels(str(worker)).inc()

    def loop_lag(self, late_s: float) -> None:
        """How late the router's watchdog ran (``RouterService.watch_tick``): the last pass and
        the worst since start."""
        late_s = max(0.0, late_s)
        self.loop_lag_s.set(late_s)
        self._max_lag_s = max(self._max_lag_s, late_s)
        self.loop_lag_max_s.set(self._max_lag_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
