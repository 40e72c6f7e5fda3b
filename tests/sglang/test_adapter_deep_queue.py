"""The plugin at deep queues: arrival and pass costs that must not grow with the queue.

``bench/bench_sglang_adapter.py`` times them; these tests pin what the numbers rest on: an
arrival never scans SGLang's waiting queue (an O(queue) scan per arrival is O(queue²) for a
burst), the queue position lookup is exact, and the bench queues its requests through the
arrival hook as a server does, so its first pass does no arrival work.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_rig import Rig, make_req

from sgl_fair.policies.base import Rejection
from sgl_fair.worker.sglang import adapter, plugin
from sgl_fair.worker.sglang import ledger as ledger_mod
from sgl_fair.worker.sglang.settings import PluginSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


pytestmark = pytest.mark.usefixtures("plugin_hooks")  # conftest.py


class NoScan(list):
    """A waiting queue that fails any full scan."""

    def __iter__(self):
        raise AssertionError("the waiting queue was scanned")


def fair_scheduler(policy: str = "dlpm"):
    rig = Rig(kv_tokens=1 << 16)
    fair = plugin.install_policy(rig.scheduler, PluginSettings(policy, {}))
    return rig, fair


def test_an_arrival_queued_at_the_end_is_not_searched_for():
    rig, fair = fair_scheduler()
    s = rig.scheduler
    s.waiting_queue = NoScan(make_req([i, i + 1], "c") for i in range(100))
    req = make_req([7, 8, 9], "d")
    plugin._around_add_request(lambda sch, r, *a, **k: list.append(sch.waiting_queue, r), s, req)
    assert fair.ledger.mirror(req) is not None  # queued: not aborted, no scan


def test_an_arrival_queued_elsewhere_or_not_at_all_is_found_by_a_scan():
    rig, fair = fair_scheduler()
    s = rig.scheduler
    s.waiting_queue = [make_req([1, 2], "c")]
    front = make_req([3, 4], "c")
    plugin._around_add_request(lambda sch, r, *a, **k: sch.waiting_queue.insert(0, r), s, front)
    assert fair.ledger.mirror(front) is not None
    refused = make_req([5, 6], "c")  # SGLang's queue limit turned it away
    plugin._around_add_request(lambda sch, r, *a, **k: None, s, refused)
    assert fair.ledger.mirror(refused) is None
    assert fair.ledger.num_rejected == 0 and len(fair.ledger) == 1


class EqAll:
    """A queue entry whose ``==`` says yes to anything: positions must go by identity."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def test_queue_positions_go_by_identity():
    queue = [EqAll() for _ in range(6)]
    for i, r in enumerate(queue):
        assert adapter._index(queue, r, 0) == i
        assert adapter._index(queue, r, i) == i
        assert adapter._index(queue, r, i + 1) == -1
    assert adapter._index(queue, object(), 0) == -1


def test_reconcile_finds_departures_and_unseen_arrivals():
    rig, fair = fair_scheduler()
    reqs = [make_req([i, i + 1, i + 2], f"c{i % 3}") for i in range(10)]
    for r in reqs[:8]:
        fair.ledger.arrived(r)
    queue = reqs[2:]  # 0 and 1 left the queue; 8 and 9 were queued without the hook
    fair.ledger.reconcile_waiting(queue)
    assert [fair.ledger.mirror(r) is not None for r in reqs] == [False] * 2 + [True] * 8
    assert len(fair.ledger) == 8


@pytest.mark.parametrize("hooked", [True, False])
def test_the_bench_does_arrivals_outside_the_pass_as_a_server_does(monkeypatch, hooked):
    import bench_sglang_adapter as bench

    in_pass = []
    real_calc, real_arrived = adapter.FairSchedulePolicy.calc_priority, ledger_mod.Ledger.arrived

    def calc(self, *a, **k):
        in_pass.append(0)
        try:
            return real_calc(self, *a, **k)
        finally:
            in_pass.pop()

    arrivals = SimpleNamespace(outside=0, inside=0)

    def arrived(self, req):
        if in_pass:
            arrivals.inside += 1
        else:
            arrivals.outside += 1
        return real_arrived(self, req)

    monkeypatch.setattr(adapter.FairSchedulePolicy, "calc_priority", calc)
    monkeypatch.setattr(ledger_mod.Ledger, "arrived", arrived)
    n = 40
    arrival_s, first_s, next_s, order = bench.two_passes("plugin", "dlpm", n, 4096, hooked)
    assert (arrivals.outside, arrivals.inside) == ((n, 0) if hooked else (0, n))
    assert arrival_s > 0 and first_s > 0 and next_s > 0 and order[0]
    exact = bench.two_passes("plugin-exact", "dlpm", n, 4096, hooked)[3]
    assert order == exact


def test_a_new_req_under_a_held_rid_is_held_beside_the_old_one_by_identity():
    """SGLang holds two live requests under one rid: each is its own (it dropped the old one,
    whose next pass then sorted a None mirror and stopped SGLang's scheduler)."""
    rig, fair = fair_scheduler("fcfs")
    ledger = fair.ledger
    old, new = make_req([1, 2], "c", rid="x"), make_req([1, 3], "c", rid="x")
    ledger.arrived(old)
    ledger.arrived(new)
    m_old, m_new = ledger.mirrors_of([old, new])
    assert m_old is not None and m_new is not None and m_old is not m_new and len(ledger) == 2
    assert ledger.req_of(m_old) is old and ledger.req_of(m_new) is new
    ledger.reconcile_waiting([new])  # the old one left the queue unadmitted: aborted
    assert ledger.mirror(old) is None and ledger.mirror(new) is m_new
    ledger.finished(old)  # not held any more: nothing happens
    assert len(ledger) == 1
    ledger.aborted(new)
    assert len(ledger) == 0 and ledger.mirrors_of([old, new]) == [None, None]


def test_reconcile_says_when_the_queue_is_exactly_the_waiting_set():
    """The pass reads the queue from the waiting set, with no per-request lookup, only when
    the queue holds exactly the waiting mirrors' requests: not with a request the policy
    refused still queued, a running one queued again unseen, or one request queued twice."""
    rig, fair = fair_scheduler("fcfs")
    ledger = fair.ledger
    a, b, c = (make_req([1, 2, i], "c", rid=f"q{i}") for i in range(3))
    for r in (a, b, c):
        ledger.arrived(r)
    assert ledger.reconcile_waiting([c, a, b])  # any order: the set decides
    assert ledger.waiting.hosts() == [a, b, c]  # in arrival order, SGLang's own objects
    assert not ledger.reconcile_waiting([a, b, c, c])  # twice
    ledger.admitted(a, 3)
    assert not ledger.reconcile_waiting([a, b, c])  # a runs, yet it is queued
    assert ledger.reconcile_waiting([b, c])
    stranger = make_req([9], "c", rid="s")
    ledger.policy.on_arrival = lambda m, now: Rejection("full")  # refuses the next
    assert not ledger.reconcile_waiting([b, c, stranger])  # refused, still queued
