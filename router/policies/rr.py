"""Round robin over the alive workers (SGLang's default data-parallel dispatch; SPEC §3).

Locality and load are ignored. The cycle is kept as the last worker id chosen, so a worker
joining or leaving neither skips nor repeats anyone. No options.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_fair.request import Request
from sgl_fair.router.global_tree import GlobalMatch
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    next_in_cycle,
    register_router_policy,
)


@register_router_policy("rr")
class RoundRobin(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self._last: int | None = None

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        self._last = next_in_cycle(view.workers, self._last)
        return self._last
