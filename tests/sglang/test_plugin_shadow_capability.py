"""The plugin keeps a shadow of SGLang's cache only for a policy that asks prefix lengths.

The shadow of the unified cache drains SGLang's KV events on every admission pass (issue 39:
~4 ms a pass in a live server, for fcfs and vtc too, whose order never asks a prefix length).
A policy declares whether it asks (``BasePolicy.asks_prefix_len``); for the others the
plugin builds none and leaves the cache's ``take_events`` as SGLang made it.
"""

from __future__ import annotations

import pytest
from sglang_rig import Rig

from sgl_fair.worker.sglang import plugin, shadow_events
from sgl_fair.worker.sglang.settings import PluginSettings

pytestmark = pytest.mark.usefixtures("plugin_hooks")


@pytest.mark.parametrize(("policy", "shadowed"), [("vtc", False), ("fcfs", False),
                                                  ("fairserve", False), ("dlpm", True),
                                                  ("lpm", True)])  # fmt: skip
def test_only_a_policy_that_asks_prefix_lengths_gets_a_shadow(policy, shadowed):
    rig = Rig(cache="unified")
    own = rig.tree.take_events
    fair = plugin.install_policy(rig.scheduler, PluginSettings(policy, {}))
    try:
        assert isinstance(fair.shadow, shadow_events.EventShadow) is shadowed
        # SGLang's publisher takes the events from the cache's own method, unwrapped
        assert (rig.tree.take_events == own) is not shadowed
    finally:
        fair.detach()
