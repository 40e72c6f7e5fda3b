"""RPM: per-client requests-per-minute limit in front of FCFS (the VTC paper's baseline).

A request is rejected (HTTP 429) when its client already had ``limit`` requests
*accepted* in the current window; rejected requests do not count against the limit,
so a client gets exactly ``limit`` requests per window. Windows (``window``):

* ``"sliding"`` (default, the VTC artifact's): the last ``window_s`` seconds;
* ``"fixed"`` (the paper's text): fixed windows ``[k·window_s, (k+1)·window_s)`` of the
  clock — the count restarts at each boundary (so up to ``2·limit`` can pass in
  ``window_s`` straddling one), and a refused request may retry at the next boundary.

State per client is bounded: a client whose window holds no accepted request is forgotten
(its count is 0 either way), when it next arrives and in an amortized sweep of all clients.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import BasePolicy, Rejection, SchedulerView, register
from sgl_fair.request import ClientId, Request

WINDOWS = ("sliding", "fixed")
_SWEEP_MIN = 1024  # sweep the clients once they outgrow this (then 2x, amortized)


@register("rpm")
class RPM(BasePolicy):
    @dataclass(frozen=True)
    class Config:
        limit: int = 20
        window_s: float = 60.0
        window: str = "sliding"

        def __post_init__(self) -> None:
            if self.limit < 1:
                raise ValueError(f"rpm: limit must be >= 1 (got {self.limit})")
            if self.window_s <= 0:
                raise ValueError(f"rpm: window_s must be > 0 (got {self.window_s})")
            if self.window not in WINDOWS:
                raise ValueError(
                    f"rpm: window must be one of {', '.join(WINDOWS)} (got {self.window!r})"
                )

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self._accepted: dict[ClientId, deque[float]] = {}  # sliding: accepted times
        self._fixed: dict[ClientId, tuple[int, int]] = {}  # fixed: (window index, count)
        self.sweep_min = self._sweep_at = _SWEEP_MIN  # (tests lower it)

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        if self.config.window == "fixed":
            rejection = self._fixed_window(req.client, now)
        else:
            rejection = self._sliding_window(req.client, now)
        if rejection is not None:
            return rejection
        if len(self._accepted) + len(self._fixed) > self._sweep_at:
            self._sweep(now)
        return super().on_arrival(req, now)

    def _sliding_window(self, client: ClientId, now: float) -> Rejection | None:
        times = self._accepted.get(client)
        if times is None:
            times = self._accepted[client] = deque()
        self._prune(times, now)
        if len(times) >= self.config.limit:
            return self._reject(client, times[0] + self.config.window_s - now)
        times.append(now)
        return None

    def _fixed_window(self, client: ClientId, now: float) -> Rejection | None:
        k = math.floor(now / self.config.window_s)
        start, count = self._fixed.get(client, (k, 0))
        if start != k:
            count = 0
        if count >= self.config.limit:
            return self._reject(client, (k + 1) * self.config.window_s - now)
        self._fixed[client] = (k, count + 1)
        return None

    def _reject(self, client: ClientId, retry_after_s: float) -> Rejection:
        return Rejection(
            f"client {client!r} exceeded {self.config.limit} requests "
            f"per {self.config.window_s:g} s",
            retry_after_s=max(retry_after_s, 0.0),
        )

    def _prune(self, times: deque[float], now: float) -> None:
        horizon = now - self.config.window_s
        while times and times[0] <= horizon:
            times.popleft()

    def _sweep(self, now: float) -> None:
        """Forget every client whose window is empty (exact: its count is 0 either way)."""
        for c in list(self._accepted):
            times = self._accepted[c]
            self._prune(times, now)
            if not times:
                del self._accepted[c]
        k = math.floor(now / self.config.window_s)
        self._fixed = {c: v for c, v in self._fixed.items() if v[0] == k}
        self._sweep_at = 2 * (len(self._accepted) + len(self._fixed)) + self.sweep_min

    def num_clients(self) -> int:
        """Clients with state held (an accepted request in their window, or not yet swept)."""
        return len(self._accepted) + len(self._fixed)

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        return iter(list(waiting))
