"""FairServe's measures on ``/metrics``, per tenant and app: users, interactions, queueing.

The experiment rows and the load-test report compute these over a run; a server has no run,
so here they are Prometheus counters and histograms over the server's life, and the
percentages are ratios of counters (PromQL in ``docs/operators.md``):

* ``sgl_fair_app_output_tokens_total`` (throughput: its ``rate``), ``sgl_fair_app_ttft_seconds``
  and ``sgl_fair_queue_delay_seconds`` (the waiting-queue delay the worker reports for each
  answered call; P50 / P99 with ``histogram_quantile``);
* ``sgl_fair_interactions_throttled_total``: interactions with a call refused by an admission
  limit (FairServe's OIT, at a worker or the router, or ``rpm``'s per-client limit); a call
  without an ``interaction_id`` is an interaction of its own;
* ``sgl_fair_tokens_wasted_total``: prompt + output tokens of an interaction's answered calls
  once one of its calls was throttled (the work its user never gets an answer from), as the
  load-test report counts them: what it had spent when the throttle came, and what it
  spends after;
* ``sgl_fair_users_total``, ``..._users_served_total`` (a call answered),
  ``..._users_queued_total`` (a call that waited in a worker's queue more than ``queued_s``:
  ``sgl_fair.records.QUEUED_S``, 1 s, as in the experiments) and
  ``..._users_throttled_total``: each user counted once per (tenant, app), so "% of users
  who saw queueing delay" is ``users_queued / users``.

A user is a request's client id (with auth on, bound to the API key's tenant). Memory is
bounded: at most ``max_tracked`` users and as many interactions are remembered, the least
recently seen forgotten first; one forgotten and seen again counts again. ``app`` labels are
bounded by the caller (``Telemetry.app_label``), ``tenant`` labels too (``tenant_label``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from sgl_fair.records import QUEUED_S

_SERVED, _QUEUED, _THROTTLED = 1, 2, 4  # what a user has been counted for, as bits


class _Interaction:
    __slots__ = ("tokens", "throttled")

    def __init__(self) -> None:
        self.tokens = 0  # prompt + output tokens of its answered calls
        self.throttled = False


class InteractionMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        buckets: tuple[float, ...],
        app_label: Callable[[str | None], str],
        *,
        prefix: str = "sgl_fair_",
        max_tracked: int = 100_000,
        queued_s: float = QUEUED_S,
        tenant_label: Callable[[str], str] = str,
    ) -> None:
        self.tenant_label = tenant_label  # bounded label values (``Telemetry.tenant_label``)
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1 (got {max_tracked})")
        self.app_label = app_label
        self.max_tracked = max_tracked
        self.queued_s = queued_s
        r, p, labels = registry, prefix, ["tenant", "app"]
        self.output_tokens = Counter(
            p + "app_output_tokens", "Generated tokens, by tenant and app", labels, registry=r
        )
        self.ttft = Histogram(
            p + "app_ttft_seconds", "Time to first token, by tenant and app", labels,
            buckets=buckets, registry=r,
        )  # fmt: skip
        self.queue_delay = Histogram(
            p + "queue_delay_seconds",
            "Time an answered call waited in a worker's queue, by tenant and app",
            labels, buckets=buckets, registry=r,
        )  # fmt: skip
        self.interactions_throttled = Counter(
            p + "interactions_throttled",
            "Interactions with a call refused by an admission limit (FairServe's OIT or rpm)",
            labels, registry=r,
        )  # fmt: skip
        self.tokens_wasted = Counter(
            p + "tokens_wasted",
            "Prompt + output tokens of answered calls of interactions that were throttled",
            labels, registry=r,
        )  # fmt: skip
        self.users = Counter(p + "users", "Users seen, by tenant and app", labels, registry=r)
        self.users_served = Counter(
            p + "users_served", "Users with an answered call", labels, registry=r
        )
        self.users_queued = Counter(
            p + "users_queued",
            f"Users with a call that waited over {queued_s:g} s in a worker's queue",
            labels, registry=r,
        )  # fmt: skip
        self.users_throttled = Counter(
            p + "users_throttled", "Users with a throttled call", labels, registry=r
        )
        self._users: OrderedDict[tuple[str, str, str], int] = OrderedDict()
        self._interactions: OrderedDict[tuple[str, str], _Interaction] = OrderedDict()

    # ---- what the router accounts ----------------------------------------------------------

    def answered(
        self,
        tenant: str,
        app: str | None,
        user: str,
        interaction_id: str | None,
        *,
        tokens: int,
        output_len: int,
        ttft_s: float | None,
        queue_s: float | None,
    ) -> None:
        """A call the worker answered (``tokens``: its prompt + output tokens)."""
        tl, label = self.tenant_label(tenant), self.app_label(app)
        self.output_tokens.labels(tl, label).inc(output_len)
        if ttft_s is not None:
            self.ttft.labels(tl, label).observe(ttft_s)
        flags = _SERVED
        if queue_s is not None:
            self.queue_delay.labels(tl, label).observe(queue_s)
            if queue_s > self.queued_s:
                flags |= _QUEUED
        self._user(tenant, label, user, flags)
        if interaction_id is not None:
            it = self._interaction(tenant, interaction_id)
            it.tokens += tokens
            if it.throttled:
                self.tokens_wasted.labels(tl, label).inc(tokens)

    def throttled(self, tenant: str, app: str | None, user: str, interaction_id: str | None):
        """A call refused by an admission limit."""
        tl, label = self.tenant_label(tenant), self.app_label(app)
        self._user(tenant, label, user, _THROTTLED)
        if interaction_id is None:  # a call of its own: a whole interaction, nothing spent
            self.interactions_throttled.labels(tl, label).inc()
            return
        it = self._interaction(tenant, interaction_id)
        if not it.throttled:
            it.throttled = True
            self.interactions_throttled.labels(tl, label).inc()
            if it.tokens:
                self.tokens_wasted.labels(tl, label).inc(it.tokens)

    def seen(self, tenant: str, app: str | None, user: str) -> None:
        """A call that was neither answered nor throttled (refused for capacity, aborted)."""
        self._user(tenant, self.app_label(app), user, 0)

    # ---- bounded memory ---------------------------------------------------------------------

    def _user(self, tenant: str, app: str, user: str, flags: int) -> None:
        key = (tenant, app, user)
        tenant = self.tenant_label(tenant)  # (the key keeps the tenant, the label may fold)
        had = self._users.get(key)
        if had is None:
            self.users.labels(tenant, app).inc()
            had = 0
            if len(self._users) >= self.max_tracked:
                self._users.popitem(last=False)
        else:
            self._users.move_to_end(key)
        new = flags & ~had
        if new:
            if new & _SERVED:
                self.users_served.labels(tenant, app).inc()
            if new & _QUEUED:
                self.users_queued.labels(tenant, app).inc()
            if new & _THROTTLED:
                self.users_throttled.labels(tenant, app).inc()
        self._users[key] = had | flags

    def _interaction(self, tenant: str, interaction_id: str) -> _Interaction:
        key = (tenant, interaction_id)
        it = self._interactions.get(key)
        if it is None:
            it = self._interactions[key] = _Interaction()
            if len(self._interactions) > self.max_tracked:
                self._interactions.popitem(last=False)
        else:
            self._interactions.move_to_end(key)
        return it
