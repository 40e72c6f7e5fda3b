"""Switching the SGLang plugin on: two environment variables, read in every scheduler process.

Installing sgl-fair registers an entry point in SGLang's ``sglang.srt.plugins`` group, so
SGLang calls our ``register()`` in each of its processes. It does nothing unless
``SGLFAIR_SCHEDULE_POLICY`` names a policy: a plain ``sglang.launch_server`` stays plain.
``python -m sgl_fair.launch --backend sglang`` sets both variables for the servers it starts::

    SGLFAIR_SCHEDULE_POLICY=dlpm
    SGLFAIR_SCHEDULE_POLICY_OPTS='{"quantum": 2048, "weights": {"alice": 2}}'

Pure: no sglang import, so the launcher and tests use it anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_POLICY = "SGLFAIR_SCHEDULE_POLICY"
ENV_POLICY_OPTS = "SGLFAIR_SCHEDULE_POLICY_OPTS"


@dataclass(frozen=True)
class PluginSettings:
    policy: str
    opts: dict[str, Any] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The environment that switches the plugin on with these settings."""
        return {ENV_POLICY: self.policy, ENV_POLICY_OPTS: json.dumps(self.opts, sort_keys=True)}

    def make_policy(self) -> Any:
        from sgl_fair.policies import make_policy

        return make_policy(self.policy, **self.opts)

    def asks_prefix_len(self) -> bool:
        """Whether the policy's order may ask prefix lengths (``PolicyTraits.asks_prefix_len``)."""
        from sgl_fair.policies import PolicyTraits, policy_class

        return PolicyTraits.of(policy_class(self.policy)).asks_prefix_len

    def orders_by_time(self) -> bool:
        """Whether the policy's order reads the clock (``PolicyTraits.orders_by_time``)."""
        from sgl_fair.policies import PolicyTraits, policy_class

        return PolicyTraits.of(policy_class(self.policy)).orders_by_time


# RT / BE as SGLang's integer ``priority`` (its default direction: higher runs first). The gap
# exceeds SGLang's --priority-scheduling-preemption-threshold default (10), so with
# --enable-priority-scheduling a waiting RT request may preempt running BE ones.
RT_PRIORITY = 100
BE_PRIORITY = 0


def class_priority_values(low_first: bool) -> tuple[int, int]:
    """(RT, BE) as SGLang's ``priority`` on a server whose direction is ``low_first`` (its
    ``--schedule-low-priority-values-first``): RT always ranks first, so it may preempt BE
    and BE never preempts RT."""
    return (BE_PRIORITY, RT_PRIORITY) if low_first else (RT_PRIORITY, BE_PRIORITY)


def is_rt_priority(priority: int | None, low_first: bool) -> bool:
    """Whether SGLang's ``priority`` names the RT class (``class_priority_values``)."""
    if priority is None:
        return False
    rt, _be = class_priority_values(low_first)
    return priority <= rt if low_first else priority >= rt


# An RT request's SLOs ride in SGLang's `custom_params` under SLO_PARAM (sgl_fair.request);
# without them a request has the defaults (0.4 s / 0.2 s).


def uses_classes(cls: type) -> bool:
    """A policy that orders by RT/BE class inside SGLang (BROS): its servers run SGLang's
    priority scheduling and its bridges send each request's class as ``priority``."""
    from sgl_fair.policies import PolicyTraits

    return PolicyTraits.of(cls).uses_service_classes


def batch_selecting(cls: type) -> bool:
    """A policy that only selects whole batches (seam #1b: RR), which the plugin cannot host.
    One that also has an admission order for such hosts (``admission_order``: BROS) runs
    inside SGLang with that order; SGLang decodes every running request itself."""
    from sgl_fair.policies import PolicyTraits

    traits = PolicyTraits.of(cls)
    return traits.batch_selecting and not traits.admission_order


def settings_from_env(environ: Mapping[str, str] | None = None) -> PluginSettings | None:
    """The plugin's settings, or None when it is off; bad values raise a one-line ValueError
    naming the variable (the plugin turns it into a start-up failure, never a silent
    fallback to SGLang's own policy)."""
    env = os.environ if environ is None else environ
    policy = env.get(ENV_POLICY, "").strip()
    if not policy:
        return None
    from sgl_fair.policies import policy_class, policy_names

    if policy not in policy_names():
        raise ValueError(f"{ENV_POLICY}={policy!r} is unknown; choose from {policy_names()}")
    if batch_selecting(policy_class(policy)):
        raise ValueError(
            f"{ENV_POLICY}={policy!r} chooses each iteration's whole running batch, which "
            "SGLang's scheduler does not let a plugin do; it runs on our own workers "
            "(--backend sim or torch), or pick an admission-order policy here"
        )
    raw = env.get(ENV_POLICY_OPTS, "").strip() or "{}"
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_POLICY_OPTS} is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise ValueError(f"{ENV_POLICY_OPTS} must be a JSON object (got {type(opts).__name__})")
    settings = PluginSettings(policy, opts)
    settings.make_policy()  # options are checked now, with the policy's own one-line errors
    return settings
