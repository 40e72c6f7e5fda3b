"""Router replicas' shared fairness state: the workers' service reports merged with a replica's
own unreported dispatches (router/replica_state.py, worker/service_ledger.py, issue 34)."""

from __future__ import annotations

import heapq
import random

import pytest

from sgl_fair.messages import Finished, FinishReason, Load, ServiceReport
from sgl_fair.request import Request
from sgl_fair.router.policies import make_router_policy
from sgl_fair.router.replica import ReplicaRouter
from sgl_fair.router.replica_state import ReplicaState
from sgl_fair.worker.service_ledger import ServiceLedger


def _report(clients=(), seqs=(), num_requests=0) -> ServiceReport:
    return ServiceReport(tuple(clients), tuple(seqs), num_requests)


def test_own_dispatches_count_once_before_during_and_after_the_report_that_covers_them():
    s = ReplicaState(0)
    assert s.dispatched(1, "a", 100) == 1
    assert s.dispatched(1, "a", 50) == 2
    assert s.service(1, "a") == (150, 0)
    # The worker has received only the first: the second is still ours, unreported.
    assert s.report(1, 1.0, _report([("a", 100, 0)], [(0, 1)], 1)) == []
    assert s.service(1, "a") == (150, 0)
    # Both received, plus 30 tokens another replica (1) dispatched: only those are new.
    peers = s.report(1, 2.0, _report([("a", 180, 0)], [(0, 2), (1, 1)], 3))
    assert peers == [("a", 30, 0)]
    assert s.service(1, "a") == (180, 0)
    assert s.peer_requests(1) == 1  # 3 on the worker, 2 of them ours
    # The same totals again: nothing new, nothing counted twice.
    assert s.report(1, 3.0, _report([("a", 180, 0)], [(0, 2), (1, 1)], 3)) == []
    assert s.service(1, "a") == (180, 0)


def test_own_outputs_are_not_doubled_when_the_report_catches_up():
    s = ReplicaState(0)
    s.dispatched(0, "a", 10)
    s.finished(0, "a", 7)  # our Finished arrived before the worker's next report
    assert s.service(0, "a") == (10, 7)
    peers = s.report(0, 1.0, _report([("a", 10, 7), ("b", 5, 4)], [(0, 1), (2, 1)], 1))
    assert peers == [("b", 5, 4)]  # b is all another replica's; a's output was ours
    assert s.service(0, "a") == (10, 7) and s.service(0, "b") == (5, 4)
    assert s.peer_requests(0) == 1


def test_old_reports_are_ignored_and_contradictions_raise():
    s = ReplicaState(0)
    s.dispatched(0, "a", 10)
    assert s.report(0, 2.0, _report([("a", 10, 0)], [(0, 1)], 1)) == []
    assert s.report(0, 1.0, _report([("a", 99, 0)], [(0, 1)], 1)) == []  # older: ignored
    assert s.num_stale_reports == 1 and s.service(0, "a") == (10, 0)
    with pytest.raises(ValueError, match="seq 5"):  # we never sent 5
        s.report(0, 3.0, _report([("a", 10, 0)], [(0, 5)], 1))
    s.finished(0, "a", 3)
    with pytest.raises(ValueError, match="undercounts"):  # our 3 output tokens are missing
        s.report(0, 3.0, _report([("a", 10, 0)], [(0, 1)], 0))


def test_a_rejoined_workers_first_report_is_a_baseline_not_new_service():
    s = ReplicaState(0)
    s.dispatched(0, "a", 10)
    assert s.report(0, 1.0, _report([("a", 510, 0)], [(0, 1), (1, 3)], 2)) == [("a", 500, 0)]
    s.worker_removed(0)  # the policy forgot the worker's deficits with it
    assert s.service(0, "a") == (0, 0)
    assert s.dispatched(0, "a", 20) == 1  # our count starts again (the worker's too)
    # 530 of history (ours and the others'): a baseline, charged to nobody.
    assert s.report(0, 2.0, _report([("a", 530, 0)], [(0, 1), (1, 3)], 3)) == []
    assert s.service(0, "a") == (530, 0)
    # From then on only what is new counts.
    assert s.report(0, 3.0, _report([("a", 570, 0)], [(0, 1), (1, 4)], 4)) == [("a", 40, 0)]


def test_ledger_checks_order_and_reports_totals():
    ledger = ServiceLedger()
    ledger.received(0, 1, "a", 10)
    ledger.received(1, 1, "a", 5)
    with pytest.raises(ValueError, match="in order"):
        ledger.received(0, 3, "a", 1)
    ledger.sent("a", 4)
    report = ledger.report()
    assert report.clients == (("a", 15, 4),) and dict(report.seqs) == {0: 1, 1: 1}
    assert report.num_requests == 1
    ledger.sent("a", 0)  # the second request (rejected, say)
    with pytest.raises(ValueError, match="no request"):
        ledger.sent("a", 1)


def _finished(worker: int, rid: str, client: str, n_out: int, t: float) -> Finished:
    return Finished(worker, t, rid, client, FinishReason.LENGTH, (1, 2, 3), (9,) * n_out)


def test_d2lpm_replicas_see_each_others_service_and_queues_through_reports():
    a = ReplicaRouter(make_router_policy("d2lpm"), 2, replica=0)
    b = ReplicaRouter(make_router_policy("d2lpm"), 2, replica=1)
    ledgers = [ServiceLedger(), ServiceLedger()]
    req = Request(rid="r1", client="c", input_ids=tuple(range(40)), output_len=4, arrival_s=0.0)
    d = b.dispatch(req, 0.0)
    replica, seq, charge = b.last_tag
    assert (replica, seq, charge) == (1, 1, 40)
    ledgers[d.worker].received(replica, seq, "c", charge)
    before = a.policy.deficit(d.worker, "c")
    load = Load(d.worker, 0.1, 1, 0, 0, 0, 100, service=ledgers[d.worker].report())
    a.handle(load, 0.1)
    assert a.policy.deficit(d.worker, "c") == before - 40  # w_e = 1
    assert a.queue_len(d.worker) == 1  # b's request, queued there
    b.handle(load, 0.1)
    assert b.queue_len(d.worker) == 1  # its own, not counted twice
    # b's request finishes with 4 tokens: a hears of them only from the next report.
    ledgers[d.worker].sent("c", 4)
    b.handle(_finished(d.worker, "r1", "c", 4, 0.2), 0.2)
    load = Load(d.worker, 0.3, 0, 0, 0, 0, 100, service=ledgers[d.worker].report())
    for r in (a, b):
        r.handle(load, 0.3)
        assert r.queue_len(d.worker) == 0
        assert r.state.service(d.worker, "c") == (40, 4)
    assert a.policy.deficit(d.worker, "c") == before - 40 - 2 * 4  # w_o = 2


def test_a_replicas_view_is_stale_by_at_most_one_period_and_never_ahead():
    """Two replicas and two workers, each worker reporting every ``period``; every message
    takes ``delay``. At every instant, replica 0's view of each (worker, client) holds all
    service it dispatched itself, all the other's up to ``period + 2 × delay`` ago, and
    nothing not yet charged."""
    rng = random.Random(7)
    period, delay = 0.1, 0.005
    ledgers = [ServiceLedger(), ServiceLedger()]
    states = [ReplicaState(0), ReplicaState(1)]
    truth: list[tuple[float, int, int, str, int]] = []  # t, replica, worker, client, service
    events: list = []
    n = 0

    def push(t, *what):
        nonlocal n
        n += 1
        heapq.heappush(events, (t, n, what))

    for i in range(300):  # dispatches, each finishing a while after it reaches its worker
        t = rng.uniform(0.0, 3.0)
        push(t, "dispatch", rng.randrange(2), rng.randrange(2), rng.choice("ab"), i)
    for k in range(1, 40):
        for u in range(2):
            push(k * period, "report", u)
    max_lag = 0.0
    while events:
        t, _, what = heapq.heappop(events)
        if what[0] == "dispatch":
            _, r, u, client, i = what
            charge = rng.randint(1, 500)
            seq = states[r].dispatched(u, client, charge)
            truth.append((t, r, u, client, charge))
            push(t + delay, "arrive", r, seq, u, client, charge)
        elif what[0] == "arrive":
            _, r, seq, u, client, charge = what
            ledgers[u].received(r, seq, client, charge)
            push(t + rng.uniform(0.0, 0.3), "finish", r, u, client)
        elif what[0] == "finish":  # the worker sends Finished to its replica
            _, r, u, client = what
            out = rng.randint(1, 50)
            ledgers[u].sent(client, out)
            push(t + delay, "finished", r, u, client, out)
        elif what[0] == "finished":
            _, r, u, client, out = what
            states[r].finished(u, client, out)
            truth.append((t, r, u, client, out))  # charged by its replica on arrival
        elif what[0] == "report":
            report = ledgers[what[1]].report()
            for r in range(2):
                push(t + delay, "report_in", r, what[1], t, report)
        else:
            _, r, u, t_s, report = what
            states[r].report(u, t_s, report)
        for u in range(2):
            for client in "ab":
                seen = sum(states[0].service(u, client))
                mine = [(tt, r, x) for tt, r, uu, cc, x in truth if uu == u and cc == client]
                now_total = sum(x for _, _, x in mine)
                # Its own at once; the other replica's once a period and the network passed.
                must = sum(x for tt, r, x in mine if r == 0 or tt <= t - period - 2 * delay)
                assert must <= seen <= now_total, (t, u, client, must, seen, now_total)
                max_lag = max(max_lag, now_total - seen)
    assert max_lag > 0  # the test saw staleness (it can fail)


def test_a_report_travels_on_the_wire_with_its_load():
    from sgl_fair.transport import decode, encode

    ledger = ServiceLedger()
    ledger.received(3, 1, "tenant-a", 120)
    load = Load(2, 1.5, 0, 1, 10, 0, 100, service=ledger.report())
    assert decode(encode(load)) == load
    assert decode(encode(Load(2, 1.5, 0, 1, 10, 0, 100))).service is None


def test_an_interaction_started_through_one_replica_is_not_refused_by_another():
    """FairServe never throttles mid-interaction. Behind a balancer an interaction's calls
    reach different replicas: replica A let call 1 through; call 2 reaches replica B, which
    never saw the interaction. The worker running call 1 lists the interaction in its report,
    so B lets call 2 through while overloaded and over the limit — as one router would —
    and still refuses a new interaction of the same user."""
    from sgl_fair.router.oit import ClusterOIT

    def replica(i: int) -> ReplicaRouter:
        oit = ClusterOIT(max_waiting=0, limits={"user_limit": 2, "window_s": 60})
        return ReplicaRouter(make_router_policy("d2lpm"), 1, replica=i, oit=oit)

    a, b = replica(0), replica(1)
    ledger = ServiceLedger()

    def call(rid: str, iid: str, t: float) -> Request:
        return Request(rid=rid, client="u", input_ids=(1, 2, 3), output_len=4, arrival_s=t,
                       interaction_id=iid)  # fmt: skip

    def report(t: float) -> Load:  # overloaded: 3 waiting, max_waiting 0
        return Load(0, t, 3, 1, 0, 0, 100, service=ledger.report())

    for r in (a, b):
        r.handle(report(0.0), 0.0)
    first = call("r1", "agent-1", 0.0)
    # the user's earlier interaction: one call through A, two through B (B's window is full)
    for r, rid in ((a, "o1"), (b, "o2"), (b, "o3")):
        assert r.throttle(call(rid, "old", 0.0), 0.0) is None
    assert a.throttle(first, 0.1) is None  # A's 2nd call of the user: within the limit
    a.dispatch(first, 0.1)
    replica_, seq, charge = a.last_tag
    ledger.received(replica_, seq, "u", charge, interaction="agent-1")
    for r in (a, b):
        r.handle(report(0.2), 0.2)
    assert b.throttle(call("r2", "agent-1", 0.3), 0.3) is None  # mid-interaction: through
    assert b.throttle(call("r3", "agent-2", 0.3), 0.3) is not None  # a new one: refused
    # call 1 ends; its interaction is listed once more (its Finished went out since the last
    # report), then no more, and B keeps it for interaction_timeout_s like its own
    ledger.sent("u", 4, interaction="agent-1")
    b.handle(report(0.4), 0.4)
    assert "agent-1" not in ledger.report().interactions
    assert b.throttle(call("r4", "agent-1", 5.0), 5.0) is None
