"""Local scheduling policies, one per file, behind one Protocol and a registry.

from sgl_fair.policies import make_policy
policy = make_policy("dlpm", quantum=2048)
"""

from sgl_fair.policies.base import (
    BasePolicy,
    BatchSelecting,
    LoadAware,
    Policy,
    PolicyCaps,
    PolicyTraits,
    Predicting,
    Rejection,
    Retracting,
    SchedulerView,
    ServiceMeasure,
    Weighted,
    make_policy,
    policy_class,
    policy_names,
    register,
)

__all__ = [
    "BasePolicy",
    "BatchSelecting",
    "LoadAware",
    "Policy",
    "PolicyCaps",
    "PolicyTraits",
    "Predicting",
    "Rejection",
    "Retracting",
    "SchedulerView",
    "ServiceMeasure",
    "Weighted",
    "make_policy",
    "policy_class",
    "policy_names",
    "register",
]
