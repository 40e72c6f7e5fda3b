"""Router policies, one per file, behind one Protocol and a registry.

from sgl_fair.router.policies import make_router_policy
policy = make_router_policy("d2lpm", quantum=20_000)
"""

from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterPolicy,
    RouterView,
    least_queued,
    make_router_policy,
    register_router_policy,
    router_policy_class,
    router_policy_names,
)
from sgl_fair.router.policies.cache_aware import CacheAware
from sgl_fair.router.policies.d2lpm import D2LPM
from sgl_fair.router.policies.least_load import LeastLoad
from sgl_fair.router.policies.per_client_rr import PerClientRoundRobin
from sgl_fair.router.policies.preble import Preble
from sgl_fair.router.policies.rr import RoundRobin

__all__ = [
    "BaseRouterPolicy",
    "CacheAware",
    "D2LPM",
    "LeastLoad",
    "PerClientRoundRobin",
    "Preble",
    "RoundRobin",
    "RouterPolicy",
    "RouterView",
    "least_queued",
    "make_router_policy",
    "register_router_policy",
    "router_policy_class",
    "router_policy_names",
]
