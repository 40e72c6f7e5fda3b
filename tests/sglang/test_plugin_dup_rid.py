"""One request cannot bring SGLang down through the plugin (issue 39, item 3): two live
requests under one rid (SGLang admits them across tokenizer workers and in its rid-reuse
windows) are two requests to the plugin, each admitted, charged and finished once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang_rig import Rig, make_req

from sgl_fair.worker.sglang import plugin
from sgl_fair.worker.sglang.settings import PluginSettings

pytestmark = pytest.mark.usefixtures("plugin_hooks")


@pytest.mark.parametrize("policy", ["vtc", "dlpm", "fcfs"])
def test_two_live_requests_under_one_rid_are_two_requests(policy):
    rig = Rig()
    fair = plugin.install_policy(rig.scheduler, PluginSettings(policy, {}))
    try:
        a = make_req([1, 2, 3, 4], "alice", rid="dup")
        b = make_req([5, 6, 7, 8], "bob", rid="dup")
        for r in (a, b):
            assert fair.ledger.arrived(r) is None
            rig.queue(r)
        assert len(fair.ledger) == 2
        admitted = rig.admit()  # raised (a None mirror in the sort) before
        assert {id(r) for r in admitted} == {id(a), id(b)}
        for r in (a, b):
            r.output_ids = [9]
            r.finished_reason = FINISH_LENGTH(1)
        fair.after_batch(SimpleNamespace(reqs=[a, b]))
        assert len(fair.ledger) == 0
    finally:
        fair.detach()


def test_a_queued_request_the_policy_refused_waits_behind_the_rest():
    """A request in SGLang's queue that the ledger does not hold (its policy refused it when
    the pass met it: rpm over its limit) is left to SGLang, behind the ordered ones; before,
    its None mirror reached the sort and stopped SGLang's scheduler."""
    rig = Rig()
    fair = plugin.install_policy(rig.scheduler, PluginSettings("rpm", {"limit": 1}))
    try:
        first, over = make_req([1, 2, 3], "alice", rid="a1"), make_req([4, 5], "alice", rid="a2")
        assert fair.ledger.arrived(first) is None
        rig.queue(over)  # queued without our arrival hook (a direct path into the queue)
        rig.queue(first)
        admitted = rig.admit()
        assert [r.rid for r in admitted] == ["a1", "a2"]  # ours first, then SGLang's own
        assert fair.ledger.mirror(over) is None
    finally:
        fair.detach()
