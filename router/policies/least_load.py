"""Least load: the worker with the fewest queued requests, ties to the lowest id (SPEC §3).

"Queued" is the router's own count (dispatched − finished), so it needs no load reports.
No options.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_fair.request import Request
from sgl_fair.router.global_tree import GlobalMatch
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    least_queued,
    register_router_policy,
)


@register_router_policy("least-load")
class LeastLoad(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        pass

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        return least_queued(view.workers, view)
