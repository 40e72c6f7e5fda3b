"""FairServe's OIT at the router: throttling over the cluster, from the workers' Load reports.

The ``fairserve`` local policy throttles at each worker (``sgl_fair/policies/fairserve.py``):
with ``--dp N`` a worker sees only the share of a user's requests routed to it, so its windows
undercount the user's rate by up to N×, and it judges "overloaded" from its own queue alone.
:class:`ClusterOIT` applies the same rules once, at the router, over every arrival::

    rejection = oit.on_arrival(req, now, view)   # None: dispatch it; else refuse it (HTTP 429)
    oit.on_finished(rid, now)                    # a call ended: its interaction was active

The rules are the worker's (``FairServe.on_arrival``), with the same bookkeeping
(``fairserve_oit.Limits`` / ``Windows``):

* every arrival is counted in its user's (over all apps, and per app) and its app's sliding
  windows, throttled ones too (retrying while over a limit keeps you over it);
* only a request that **starts** an interaction may be refused — no ``interaction_id``, an id
  never seen, or one idle for more than ``interaction_timeout_s``: no call of it in flight
  through the router (let in, its ``Finished`` not yet seen) and no arrival or finish for
  that long; a call of an interaction in flight is never refused, however long its calls
  wait or run;
* only while the **cluster** is overloaded; then the user's limit is checked first, the
  app's second. The refusal is the worker's ``Rejection`` (reason, retry-after, limit).

**Cluster overload**, from each alive worker's latest ``Load`` (``view.load(w)``). By
default (``overload="any"``) the cluster is overloaded while any one worker is, by the
worker's own rule::

    num_waiting(w)  >  max_waiting     or     kv_used(w) / kv_capacity(w)  ≥  kv_threshold

D2LPM keeps each user's calls where their prefixes are, so one worker's queue can be long
while the others idle, and the users queued there are the ones OIT protects
(``fairserve-apps --dp 2``, full: users queued 17.5 % → 6.3 % with ``any``, against VTC's
29.2 %). ``overload="mean"`` judges the cluster as a whole, with ``n`` alive workers::

    Σ num_waiting  >  max_waiting × n        (the worker rule's bound, per worker on average)
    or  (1/n) Σ kv_used / kv_capacity  ≥  kv_threshold      (mean KV held by requests)

With one worker the two rules are the same.

A report the router took more than ``stale_after_s`` ago (``view.load_seen_s(w)``, the
router's own clock: no trust in the workers' clocks), or a worker with no report yet, counts
as an idle worker (nothing waiting, no KV held): unknown load never tips the cluster into
overload, and with no fresh report at all the cluster is never overloaded — no throttling on
no information.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from sgl_fair.messages import Finished, FinishReason, Load
from sgl_fair.policies.base import Rejection
from sgl_fair.policies.fairserve_oit import Limits, Windows
from sgl_fair.request import Request

# The options the fairserve local policy shares with the cluster OIT (the launcher carries
# them over from --schedule-policy-opt unless --cluster-oit-opt sets them).
SHARED_KEYS = ("max_waiting", "kv_threshold", "interaction_timeout_s", "limits")
OVERLOAD_RULES = ("mean", "any")


class LoadView(Protocol):
    """What the cluster OIT reads from the router (``Router`` implements it)."""

    @property
    def workers(self) -> tuple[int, ...]: ...

    def load(self, worker: int) -> Load | None: ...

    def load_seen_s(self, worker: int) -> float | None: ...


@dataclass(frozen=True)
class ClusterOITConfig:
    max_waiting: int = 256  # per alive worker
    kv_threshold: float = 0.9
    interaction_timeout_s: float = 120.0
    stale_after_s: float = 2.0
    # "any": any one worker by the worker rule (its own queue or KV), so a hot worker is
    # seen while the others idle; "mean": the cluster as a whole (module docstring).
    overload: str = "any"
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if isinstance(self.limits, Mapping):
            known = {f.name for f in fields(Limits)}
            bad = sorted(set(self.limits) - known)
            if bad:
                raise ValueError(
                    f"cluster OIT: unknown limits option(s) {bad}; known: {sorted(known)}"
                )
            try:
                object.__setattr__(self, "limits", Limits(**self.limits))
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"cluster OIT: bad limits {dict(self.limits)}: "
                    + str(e).replace("fairserve: ", "")
                ) from None
        if not isinstance(self.limits, Limits):
            raise ValueError(f"cluster OIT: limits must be options (limits.KEY=VALUE), "
                             f"not {self.limits!r}")  # fmt: skip
        if not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"cluster OIT: max_waiting must be an integer >= 0 "
                             f"(got {self.max_waiting!r})")  # fmt: skip
        if not isinstance(self.kv_threshold, (int, float)) or not 0 < self.kv_threshold <= 1:
            raise ValueError(f"cluster OIT: kv_threshold must be in (0, 1] "
                             f"(got {self.kv_threshold!r})")  # fmt: skip
        if self.overload not in OVERLOAD_RULES:
            raise ValueError(f"cluster OIT: overload must be one of {', '.join(OVERLOAD_RULES)} "
                             f"(got {self.overload!r})")  # fmt: skip
        for name in ("interaction_timeout_s", "stale_after_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"cluster OIT: {name} must be > 0 (got {value!r})")

    def split(self, r: int) -> ClusterOITConfig:
        """The limits of one of ``r`` router replicas behind a balancer that spreads each
        user's calls evenly (``--tenant-limits-split r``): a replica counts about 1/r of every
        window, so each limit given (``user_limit``, ``user_limits``, ``app_limits``, and the
        derived limits' floor ``min_limit``) is 1/r of the cluster's, rounded up (0 stays 0).
        Derived limits scale by themselves: they come from the counts the replica sees."""
        if r <= 1:
            return self

        def cut(n: int | None) -> int | None:
            return None if n is None else -(-n // r)

        lim = self.limits
        return dataclasses.replace(
            self,
            limits=dataclasses.replace(
                lim,
                user_limit=cut(lim.user_limit),
                user_limits=None if lim.user_limits is None
                else {a: cut(n) for a, n in lim.user_limits.items()},
                app_limits=None if lim.app_limits is None
                else {a: cut(n) for a, n in lim.app_limits.items()},
                min_limit=cut(lim.min_limit),
            ),
        )  # fmt: skip

    @classmethod
    def from_options(cls, **options: Any) -> ClusterOITConfig:
        """From ``KEY=VALUE`` options (``limits`` a mapping); unknown keys are a ValueError."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise ValueError(f"cluster OIT: unknown option(s) {bad}; known: {sorted(known)}")
        return cls(**options)


@dataclass(frozen=True)
class ClusterLoad:
    """The cluster's load as the OIT sees it (``ClusterOIT.cluster_load``)."""

    num_workers: int  # alive
    num_fresh: int  # of which have a fresh Load report
    num_waiting: int  # summed over the fresh reports
    kv_usage: float  # mean over the alive workers of kv_used / capacity (stale/missing: 0)
    busiest_waiting: int = 0  # the most waiting on one fresh worker
    busiest_kv_usage: float = 0.0  # the highest kv_used / capacity of one fresh worker


class ClusterOIT:
    def __init__(self, config: ClusterOITConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("give a config or options, not both")
        self.config = config or ClusterOITConfig.from_options(**options)
        self.windows = Windows(self.config.limits)
        self._interactions: dict[str, float] = {}  # interaction id -> last activity
        self._open: dict[str, str] = {}  # rid -> interaction id, of calls let through
        self._open_n: dict[str, int] = {}  # interaction id -> its calls in ``_open``
        self._forget_at = 4096  # forget ended interactions once this many are kept
        self.num_arrivals = 0
        self.num_throttled = 0

    # ---- load -------------------------------------------------------------------------------

    def cluster_load(self, view: LoadView, now: float) -> ClusterLoad:
        workers = view.workers
        fresh = waiting = top_waiting = 0
        kv = top_kv = 0.0
        stale = self.config.stale_after_s
        for w in workers:
            load, seen = view.load(w), view.load_seen_s(w)
            if load is None or seen is None or now - seen > stale:
                continue  # unknown: counts as idle
            fresh += 1
            waiting += load.num_waiting
            top_waiting = max(top_waiting, load.num_waiting)
            if load.kv_capacity_tokens > 0:
                used = min(load.kv_used_tokens / load.kv_capacity_tokens, 1.0)
                kv += used
                top_kv = max(top_kv, used)
        n = len(workers)
        return ClusterLoad(n, fresh, waiting, kv / n if n else 0.0, top_waiting, top_kv)

    def overloaded(self, view: LoadView, now: float) -> bool:
        load = self.cluster_load(view, now)
        if load.num_fresh == 0:
            return False
        cfg = self.config
        if cfg.overload == "any":
            return (
                load.busiest_waiting > cfg.max_waiting or load.busiest_kv_usage >= cfg.kv_threshold
            )
        return (
            load.num_waiting > cfg.max_waiting * load.num_workers
            or load.kv_usage >= cfg.kv_threshold
        )

    # ---- arrivals and finishes --------------------------------------------------------------

    def on_arrival(
        self, req: Request, now: float, view: LoadView, in_flight: Collection[str] = ()
    ) -> Rejection | None:
        """Count ``req`` and refuse it (a ``Rejection``) or let it through (None).
        ``in_flight``: the rids the router has in flight (to forget finished-unseen ones)."""
        self.num_arrivals += 1
        starts = self._starts_interaction(req, now)
        self.windows.count(req.client, req.app, now)
        if starts and self.overloaded(view, now):
            over = self.windows.over_limit(req.client, req.app, now)
            if over is not None:
                self.num_throttled += 1
                reason, retry_after, limit, limit_max = over
                window_s = self.windows.limits.window_s
                return Rejection(reason, retry_after, limit, limit_max, window_s)
        # Judged over the cluster: with more than one worker, a worker sees only some of an
        # interaction's calls, so its OIT lets this one through (one worker sees them all,
        # and sooner than the router's Load reports: it keeps judging bursts itself).
        req.oit_checked = len(view.workers) > 1
        iid = req.interaction_id
        if iid is not None:
            self._interactions[iid] = max(self._interactions.get(iid, now), now)
            if self._open.get(req.rid) != iid:
                self._close(req.rid)
                self._open[req.rid] = iid
                self._open_n[iid] = self._open_n.get(iid, 0) + 1
            self._bound(now, in_flight)
        return None

    def on_finished(self, rid: str, now: float) -> None:
        """Call ``rid`` ended (its ``Finished`` reached the router): its interaction is active
        until ``now`` (a closed-loop agent's next call comes only after this one)."""
        iid = self._close(rid)
        if iid is not None and iid in self._interactions:
            self._interactions[iid] = max(self._interactions[iid], now)

    def under_way(self, interaction_ids: Collection[str], now: float) -> None:
        """Interactions a worker reports a call of (``ServiceReport.interactions``): they
        started through another router replica; each counts as active at ``now``, as one
        this router let through does."""
        for iid in interaction_ids:
            self._interactions[iid] = max(self._interactions.get(iid, now), now)
        self._forget_ended(now)

    def _close(self, rid: str) -> str | None:
        iid = self._open.pop(rid, None)
        if iid is not None:
            n = self._open_n[iid] - 1
            if n:
                self._open_n[iid] = n
            else:
                del self._open_n[iid]
        return iid

    def in_flight(self, interaction_id: str | None, now: float) -> bool:
        """Whether ``interaction_id`` has started and not yet ended: a call of it is in flight,
        or its last arrival or finish is at most ``interaction_timeout_s`` old."""
        if interaction_id is None:
            return False
        if interaction_id in self._open_n:
            return True
        last = self._interactions.get(interaction_id)
        return last is not None and now - last <= self.config.interaction_timeout_s

    def _starts_interaction(self, req: Request, now: float) -> bool:
        return not self.in_flight(req.interaction_id, now)

    def _bound(self, now: float, in_flight: Collection[str]) -> None:
        """Forget ended interactions, and calls that ended without a ``Finished`` through the
        router (failed when their worker died, ...), once they pile up."""
        if len(self._open) > 2 * len(in_flight) + 4096:  # amortized: after it, <= in flight
            for rid in [r for r in self._open if r not in in_flight]:
                self._close(rid)  # it ended unseen: its interaction idles from now
        self._forget_ended(now)

    def _forget_ended(self, now: float) -> None:
        if len(self._interactions) > self._forget_at:
            timeout = self.config.interaction_timeout_s
            self._interactions = {
                i: t
                for i, t in self._interactions.items()
                if now - t <= timeout or i in self._open_n
            }
            self._forget_at = 2 * len(self._interactions) + 4096


def refusal(req: Request, rejection: Rejection, now: float) -> Finished:
    """The ``Finished(REJECTED)`` a worker would send for ``rejection`` (``worker=-1``: the
    router refused it), so a router refusal reaches the client exactly as a worker's does."""
    limit = None
    if rejection.limit is not None:
        limit = (rejection.limit, rejection.limit_max or 0, rejection.limit_window_s or 0.0)
    return Finished(
        -1,
        now,
        req.rid,
        req.client,
        FinishReason.REJECTED,
        req.input_ids,
        (),
        0,
        rejection.reason,
        retry_after_s=rejection.retry_after_s,
        limit=limit,
    )
