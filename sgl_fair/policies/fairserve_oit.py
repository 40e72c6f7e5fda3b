"""FairServe's OIT — overload- and interaction-driven throttling (FairServe Alg. 1 l.19-24).

Pure bookkeeping for the ``fairserve`` policy's ``on_arrival``: sliding windows of request
arrivals per user (over all its apps), per (user, app) and per app, and the limits they are
checked against. The policy decides *whether* a request may be throttled (it must start a new
interaction and the worker must be overloaded); this module answers *which limit*, if any, it
is over.

Every arrival is counted before the check, so throttled arrivals count too (Alg. 1 l.19): a
user who keeps retrying while over the limit stays over it.

Limits (requests per ``window_s``):

* per user, one of (first given):
  - ``user_limits[app]`` *(beyond the paper)*: the user's calls **of that app**;
  - ``user_limit``: the paper's global per-user limit ``T_g`` — the user's calls **over all
    its apps** (one user spreading calls over 4 apps gets ``T_g``, not 4 × ``T_g``);
  - otherwise derived from history *(beyond the paper, as the paper derives ``T_g`` from its
    trace analysis)* per app: ``limit_factor`` × the median per-user count of that app's
    users in the window (at least ``min_limit``), refreshed every ``refresh_s``, against the
    user's calls of that app. Per app, because an agent user's normal rate (several calls per
    interaction) is many chat users'.
* per app: ``app_limits[app]`` when given; otherwise ``app_limit_factor`` × the app's
  long-run mean count per window (an EWMA over past windows; none until one window has passed).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sgl_fair.request import ClientId

_NO_APP = ""
# Apps whose windows and means are held at most: app names come from clients, so past this
# many the least recently seen app is forgotten (on its next call it is new: no app limit
# until a window has passed). Its users' windows go when they empty, as for every user.
MAX_APPS = 4096


@dataclass(frozen=True)
class Limits:
    """The limits half of the policy's config (see the module docstring)."""

    window_s: float = 60.0
    user_limit: int | None = None
    user_limits: Mapping[str, int] | None = None
    app_limits: Mapping[str, int] | None = None
    limit_factor: float = 4.0
    app_limit_factor: float = 3.0
    min_limit: int = 10
    refresh_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"fairserve: limits.window_s must be > 0 (got {self.window_s})")
        given = {"user_limit": self.user_limit, "min_limit": self.min_limit}
        given.update({f"user_limits.{k}": v for k, v in (self.user_limits or {}).items()})
        given.update({f"app_limits.{k}": v for k, v in (self.app_limits or {}).items()})
        bad = {k: v for k, v in given.items() if v is not None and v < 0}
        if bad:  # 0 is allowed: no new interaction while overloaded
            raise ValueError(f"fairserve: limits must be >= 0 (got {bad})")


class Windows:
    """Sliding-window arrival counts per user, per (user, app) and per app, and the limits
    over them. A user's or (user, app)'s empty window is dropped at the next refresh (every
    ``refresh_s``), so the state held is bounded by the users seen in the last window."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._user: dict[tuple[ClientId, str], deque[float]] = {}
        self._user_all: dict[ClientId, deque[float]] = {}  # T_g's count: over all apps
        self._app: dict[str, deque[float]] = {}
        self._derived_user: dict[str, int] = {}
        self._app_mean: dict[str, float] = {}  # EWMA of per-window counts
        self._window_start: dict[str, tuple[float, int]] = {}  # app -> (start, count)
        self._recent: OrderedDict[str, None] = OrderedDict()  # apps, least recent first
        self._next_refresh_s = 0.0

    def count(self, user: ClientId, app: str | None, now: float) -> None:
        a = app or _NO_APP
        self._user.setdefault((user, a), deque()).append(now)
        self._user_all.setdefault(user, deque()).append(now)
        self._app.setdefault(a, deque()).append(now)
        self._roll_app_window(a, now)
        self._recent[a] = None
        self._recent.move_to_end(a)
        if len(self._recent) > MAX_APPS:
            self._forget_app(next(iter(self._recent)))
        if now >= self._next_refresh_s:
            self._refresh(now)

    def user_count(self, user: ClientId, app: str | None, now: float) -> int:
        """The user's calls in the window that its limit for ``app`` counts."""
        return len(self._user_times(user, app, now))

    def global_limit(self, app: str | None) -> bool:
        """Whether the user limit for ``app`` is ``T_g`` (counted over all the user's apps)."""
        lim = self.limits
        return lim.user_limit is not None and not (
            lim.user_limits and (app or _NO_APP) in lim.user_limits
        )

    def _user_times(self, user: ClientId, app: str | None, now: float) -> deque[float]:
        if self.global_limit(app):
            return self._prune(self._user_all.get(user), now)
        return self._prune(self._user.get((user, app or _NO_APP)), now)

    def app_count(self, app: str | None, now: float) -> int:
        return len(self._prune(self._app.get(app or _NO_APP), now))

    def user_limit(self, app: str | None) -> int:
        lim = self.limits
        a = app or _NO_APP
        if lim.user_limits and a in lim.user_limits:
            return lim.user_limits[a]
        if lim.user_limit is not None:
            return lim.user_limit
        return max(lim.min_limit, self._derived_user.get(a, lim.min_limit))

    def app_limit(self, app: str | None) -> int | None:
        lim = self.limits
        a = app or _NO_APP
        if lim.app_limits and a in lim.app_limits:
            return lim.app_limits[a]
        mean = self._app_mean.get(a)
        if mean is None:
            return None
        return max(lim.min_limit, round(lim.app_limit_factor * mean))

    def over_limit(
        self, user: ClientId, app: str | None, now: float
    ) -> tuple[str, float, str, int] | None:
        """(reason, retry_after_s, limit, limit_max) for the first limit exceeded — the user's
        (``limit == "user"``), then the app's (``"app"``)."""
        times = self._user_times(user, app, now)
        limit = self.user_limit(app)
        if len(times) > limit:
            scope = "over all its apps" if self.global_limit(app) else f"for app {app!r}"
            return (
                f"user {user!r} over its limit of {limit} requests per "
                f"{self.limits.window_s:g} s {scope} while the server is overloaded",
                self._retry_after(times, limit, now),
                "user",
                limit,
            )
        app_limit = self.app_limit(app)
        times = self._prune(self._app.get(app or _NO_APP), now)
        if app_limit is not None and len(times) > app_limit:
            return (
                f"app {app!r} over its limit of {app_limit} requests per "
                f"{self.limits.window_s:g} s while the server is overloaded",
                self._retry_after(times, app_limit, now),
                "app",
                app_limit,
            )
        return None

    def apps_held(self) -> int:
        """How many apps' windows and means are held (at most ``MAX_APPS``)."""
        return len(self._recent)

    # ------------------------------------------------------------ internals

    def _forget_app(self, app: str) -> None:
        del self._recent[app]
        for held in (self._app, self._app_mean, self._window_start, self._derived_user):
            held.pop(app, None)

    def _prune(self, times: deque[float] | None, now: float) -> deque[float]:
        if times is None:
            return deque()
        horizon = now - self.limits.window_s
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def _retry_after(self, times: deque[float], limit: int, now: float) -> float:
        # A retry is counted too, so it fits once all but `limit - 1` have expired.
        if limit <= 0:  # nothing fits while overloaded: retry after a window
            return self.limits.window_s
        oldest_to_expire = times[len(times) - limit]
        return max(oldest_to_expire + self.limits.window_s - now, 0.0)

    def _roll_app_window(self, app: str, now: float) -> None:
        start, n = self._window_start.get(app, (now, 0))
        window = self.limits.window_s
        if now - start >= window:
            prev = self._app_mean.get(app)
            self._app_mean[app] = n if prev is None else 0.7 * prev + 0.3 * n
            start, n = start + window * ((now - start) // window), 0
        self._window_start[app] = (start, n + 1)

    def _refresh(self, now: float) -> None:
        """Re-derive per-app user limits from the per-user counts in the window (median)."""
        per_app: dict[str, list[int]] = {}
        for key in list(self._user):
            times = self._prune(self._user[key], now)
            if not times:
                del self._user[key]
                continue
            per_app.setdefault(key[1], []).append(len(times))
        for user in list(self._user_all):
            if not self._prune(self._user_all[user], now):
                del self._user_all[user]
        factor = self.limits.limit_factor
        self._derived_user = {a: round(factor * statistics.median(c)) for a, c in per_app.items()}
        self._next_refresh_s = now + self.limits.refresh_s


LoadProbe = Callable[[], float]
"""Returns the worker's KV usage in [0, 1] (held by requests, not evictable cache)."""
