"""sgl_fair.router: the global router process (D2LPM over a global radix tree).

from sgl_fair.router import Router, make_router_policy
router = Router(make_router_policy("d2lpm"), num_workers=4)
dispatch = router.dispatch(req, now)      # -> Dispatch(worker, req, sent_s)
router.handle(msg, now)                   # Tokens / Finished / Evicted / Load
"""

from sgl_fair.router.global_tree import GlobalMatch, GlobalTree
from sgl_fair.router.policies import (
    RouterPolicy,
    RouterView,
    make_router_policy,
    router_policy_names,
)
from sgl_fair.router.router import Router, WorkerStats

__all__ = [
    "GlobalMatch",
    "GlobalTree",
    "Router",
    "RouterPolicy",
    "RouterView",
    "WorkerStats",
    "make_router_policy",
    "router_policy_names",
]
