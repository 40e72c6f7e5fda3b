"""No error of ours brings SGLang down (issue 39, item 3): each hook body runs guarded, an error
is counted and SGLang goes on in its own order; SGLang's run-time report shows the counts; a
hook SGLang did not apply stops the scheduler at start, naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang_rig import Rig, make_req

from sgl_fair.policies.vtc import VTC
from sgl_fair.worker.sglang import plugin
from sgl_fair.worker.sglang.adapter import FairSchedulePolicy

pytestmark = pytest.mark.usefixtures("plugin_hooks")


class Broken(VTC):
    """VTC whose order or token accounting raises (a bug of ours, or bad input reaching it)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def order(self, waiting, view):
        if self.where == "order":
            raise RuntimeError("order broke")
        return super().order(waiting, view)

    def on_tokens(self, req, n):
        if self.where == "tokens":
            raise RuntimeError("tokens broke")
        super().on_tokens(req, n)


def _rig(where: str) -> tuple[Rig, FairSchedulePolicy]:
    rig = Rig()
    fair = FairSchedulePolicy(Broken(where), rig.tree, shadow=False)
    rig.scheduler.policy = fair
    return rig, fair


def test_an_error_in_the_policys_order_leaves_sglangs_order_for_that_pass():
    rig, fair = _rig("order")
    try:
        reqs = [make_req([i, i + 1, i + 2], f"c{i}", rid=f"r{i}") for i in range(3)]
        for r in reqs:
            assert fair.ledger.arrived(r) is None
            rig.queue(r)
        admitted = rig.admit()  # raised into SGLang's scheduler loop before
        assert [r.rid for r in admitted] == ["r0", "r1", "r2"]  # the queue's order
        assert fair.errors.counts == {"calc_priority": 1}
        state = plugin._after_internal_state(SimpleNamespace(internal_state={}), rig.scheduler)
        report = state.internal_state[plugin.INFO_KEY]
        assert report["hook_errors"] == {"calc_priority": 1} and report["held"] == 3
    finally:
        fair.detach()


def test_an_error_in_token_accounting_is_counted_and_the_batch_goes_on():
    rig, fair = _rig("tokens")
    try:
        r = make_req([1, 2, 3], "alice", rid="a")
        fair.ledger.arrived(r)
        rig.queue(r)
        assert rig.admit() == [r]
        r.output_ids = [7]
        r.finished_reason = FINISH_LENGTH(1)
        batch = SimpleNamespace(reqs=[r])
        plugin._after_batch_result(None, rig.scheduler, batch)  # raised before
        assert fair.errors.counts == {"batch_result": 1}
    finally:
        fair.detach()


def test_aborts_mark_the_queue_and_one_reconcile_settles_them():
    rig, fair = _rig("none")
    try:
        reqs = [make_req([i, 1], "c", rid=f"r{i}") for i in range(50)]
        for r in reqs:
            fair.ledger.arrived(r)
            rig.queue(r)
        calls = []
        real = fair.ledger.reconcile_waiting
        fair.ledger.reconcile_waiting = lambda q: (calls.append(len(q)), real(q))[1]
        for r in reqs[:40]:  # an abort storm: SGLang removes each, then our hook runs
            rig.scheduler.waiting_queue.remove(r)
            plugin._after_abort(None, rig.scheduler)
        assert calls == [] and fair.ledger.dirty  # was one whole-queue reconcile per abort
        plugin._after_batch_result(None, rig.scheduler, SimpleNamespace(reqs=[]))
        assert calls == [10] and len(fair.ledger) == 10 and not fair.ledger.dirty
    finally:
        fair.detach()


def test_every_hook_sglang_applied_is_checked_at_install():
    plugin.check_hooks()  # the fixture applied them all, as SGLang's load_plugins() does

    def plain():
        return None

    assert not plugin.carries(plain, plugin._after_abort)
    from sglang.srt.managers.scheduler import Scheduler

    assert plugin.carries(Scheduler.abort_request, plugin._after_abort)
    assert not plugin.carries(Scheduler.abort_request, plugin._after_retract)
