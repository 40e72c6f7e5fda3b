"""RPM: per-client requests-per-minute limit in front of FCFS (the VTC paper's baseline).

A request is rejected (HTTP 429) when its client already had ``limit`` requests
*accepted* in the last ``window_s`` seconds; rejected requests do not count
against the limit, so a client gets exactly ``limit`` requests per window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import BasePolicy, Rejection, SchedulerView, register
from sgl_fair.request import ClientId, Request


@register("rpm")
class RPM(BasePolicy):
    @dataclass(frozen=True)
    class Config:
        limit: int = 20
        window_s: float = 60.0

        def __post_init__(self) -> None:
            if self.limit < 1:
                raise ValueError(f"rpm: limit must be >= 1 (got {self.limit})")
            if self.window_s <= 0:
                raise ValueError(f"rpm: window_s must be > 0 (got {self.window_s})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self._accepted: dict[ClientId, deque[float]] = {}

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        times = self._accepted.setdefault(req.client, deque())
        horizon = now - self.config.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if len(times) >= self.config.limit:
            retry = times[0] + self.config.window_s - now
            return Rejection(
                f"client {req.client!r} exceeded {self.config.limit} requests "
                f"per {self.config.window_s:g} s",
                retry_after_s=max(retry, 0.0),
            )
        times.append(now)
        return super().on_arrival(req, now)

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        return iter(list(waiting))
