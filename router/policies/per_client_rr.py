"""Per-client round robin: each client's requests cycle over the workers (SPEC §3).

The DLPM paper's VTC baseline for more than one worker: every client is spread evenly, so
a backlogged client is backlogged on every worker and fair local schedulers (VTC) make the
whole cluster fair (Thm A.6). Each client keeps its own pointer, starting at the lowest
id. No options.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_fair.request import ClientId, Request
from sgl_fair.router.global_tree import GlobalMatch
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    next_in_cycle,
    register_router_policy,
)


@register_router_policy("per-client-rr")
class PerClientRoundRobin(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self._last: dict[ClientId, int] = {}

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        worker = next_in_cycle(view.workers, self._last.get(req.client))
        self._last[req.client] = worker
        return worker
