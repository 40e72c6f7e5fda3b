"""Router replicas' shared fairness state: a replica's own service plus the other replicas'
rows in the workers' reports (router/replica_state.py, worker/service_ledger.py, issues 34
and 40)."""

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

BOOT = 77


def _report(rows=(), requests=(), num_requests=0, *, full=True, boot=BOOT) -> ServiceReport:
    """Rows as (replica, client, extend, output[, born=1])."""
    rows = tuple(r if len(r) == 5 else (*r, 1) for r in rows)
    return ServiceReport(boot, rows, full, tuple(requests), num_requests)


def _base(s: ReplicaState, worker: int = 1, t: float = 0.0) -> None:
    assert s.report(worker, t, _report()) == []  # the boot's first snapshot: a baseline


def test_own_service_counts_at_once_and_only_the_others_rows_add_to_it():
    s = ReplicaState(0)
    _base(s)
    s.dispatched(1, "a", 100)
    s.dispatched(1, "a", 50)
    assert s.service(1, "a") == (150, 0)
    # The worker has received only the first: its row for us says 100; ours stays ours.
    assert s.report(1, 1.0, _report([(0, "a", 100, 0)], [(0, 1)], 1)) == []
    assert s.service(1, "a") == (150, 0)
    # Both received, plus 30 tokens another replica (1) dispatched: only those are new.
    peers = s.report(1, 2.0, _report([(0, "a", 150, 0), (1, "a", 30, 0)], [(0, 2), (1, 1)], 3))
    assert peers == [("a", 30, 0)]
    assert s.service(1, "a") == (180, 0)
    assert s.peer_requests(1) == 1  # 3 on the worker, 2 of them ours
    # The same totals again: nothing new, nothing counted twice.
    assert s.report(1, 3.0, _report([(0, "a", 150, 0), (1, "a", 30, 0)], [(0, 2), (1, 1)], 3)) == []
    assert s.service(1, "a") == (180, 0)
    # A report of only the changed rows (not full) keeps the others.
    peers = s.report(1, 4.0, _report([(2, "a", 5, 0)], [(0, 2), (1, 1), (2, 1)], 4, full=False))
    assert peers == [("a", 5, 0)] and s.service(1, "a") == (185, 0)


def test_own_outputs_are_never_read_back_from_a_report():
    s = ReplicaState(0)
    _base(s, 0)
    s.dispatched(0, "a", 10)
    s.finished(0, "a", 7)  # our Finished arrived before the worker's next report
    assert s.service(0, "a") == (10, 7)
    rows = [(0, "a", 10, 7), (2, "b", 5, 4)]
    assert s.report(0, 1.0, _report(rows, [(2, 1)], 1)) == [("b", 5, 4)]
    assert s.service(0, "a") == (10, 7) and s.service(0, "b") == (5, 4)
    assert s.peer_requests(0) == 1
    # a report that says anything of our own row changes nothing of our view
    assert s.report(0, 2.0, _report([(0, "a", 999, 999), (2, "b", 5, 4)], [], 0)) == []
    assert s.service(0, "a") == (10, 7)


def test_old_reports_are_ignored_and_a_report_that_fails_a_check_changes_nothing():
    s = ReplicaState(0)
    _base(s, 0)
    assert s.report(0, 2.0, _report([(1, "a", 10, 0), (1, "b", 3, 0)])) == [
        ("a", 10, 0),
        ("b", 3, 0),
    ]
    assert s.report(0, 1.0, _report([(1, "a", 99, 0)])) == []  # older: ignored
    assert s.num_stale_reports == 1 and s.service(0, "a") == (10, 0)
    bad = _report([(1, "b", 9, 0), (1, "a", 4, 0)])  # b grew, a went back: refused whole
    with pytest.raises(ValueError, match="went back"):
        s.report(0, 3.0, bad)
    assert s.service(0, "a") == (10, 0) and s.service(0, "b") == (3, 0)
    assert s.report(0, 3.0, _report([(1, "a", 10, 0), (1, "b", 9, 0)])) == [("b", 6, 0)]


def test_a_late_replica_charges_no_history_and_waits_for_a_snapshot():
    """Before: a fresh or restarted replica's first report charged every worker's whole
    history as new peer service (10,000,000 tokens against 10,000 for a newer worker)."""
    s = ReplicaState(0)
    history = [(1, "a", 10_000_000, 2_000_000), (2, "b", 500, 0)]
    assert s.report(0, 1.0, _report(history[:1], full=False)) == []  # no snapshot yet
    assert not s.has_baseline(0) and s.service(0, "a") == (0, 0)
    assert s.report(0, 2.0, _report(history)) == []  # the snapshot: a baseline
    assert s.has_baseline(0) and s.service(0, "a") == (10_000_000, 2_000_000)
    assert s.report(0, 3.0, _report([(1, "a", 10_000_040, 2_000_000)], full=False)) == [
        ("a", 40, 0)
    ]


def test_a_new_boot_or_a_rejoined_worker_starts_from_a_baseline():
    s = ReplicaState(0)
    _base(s, 0)
    assert s.report(0, 1.0, _report([(1, "a", 500, 0)])) == [("a", 500, 0)]
    s.worker_removed(0)  # the policy forgot the worker's service with it
    assert s.service(0, "a") == (0, 0)
    s.dispatched(0, "a", 20)
    # 530 of history: a baseline, charged to nobody; our own 20 stays counted by us
    assert s.report(0, 2.0, _report([(1, "a", 510, 0), (0, "a", 20, 0)])) == []
    assert s.service(0, "a") == (530, 0)
    assert s.report(0, 3.0, _report([(1, "a", 550, 0)], full=False)) == [("a", 40, 0)]
    # the worker restarted (a new boot, the same pid or not): its rows start again
    assert s.report(0, 4.0, _report([(1, "a", 3, 0)], boot=BOOT + 1, full=False)) == []
    assert s.report(0, 5.0, _report([(1, "a", 7, 0)], boot=BOOT + 1)) == []  # baseline
    assert s.report(0, 6.0, _report([(1, "a", 9, 0)], boot=BOOT + 1)) == [("a", 2, 0)]


def test_a_forgotten_row_leaves_the_rows_not_the_view_and_comes_back_whole():
    s = ReplicaState(0)
    _base(s, 0)
    assert s.report(0, 1.0, _report([(1, "a", 50, 5, 1), (1, "b", 7, 0, 2)])) == [
        ("a", 50, 5), ("b", 7, 0)]  # fmt: skip
    assert s.report(0, 2.0, _report([(1, "b", 7, 0, 2)])) == []  # a forgotten there, idle
    assert s.num_rows(0) == 1  # forgotten here too (bounded) ...
    assert s.service(0, "a") == (50, 5)  # ... its service stays in the view
    # a comes back: a new row (born 3), all of it new
    assert s.report(0, 3.0, _report([(1, "a", 8, 0, 3)], full=False)) == [("a", 8, 0)]
    assert s.service(0, "a") == (58, 5)
    # born again between two reports this replica saw: all of the new row is new too
    assert s.report(0, 4.0, _report([(1, "a", 2, 0, 4)], full=False)) == [("a", 2, 0)]
    assert s.service(0, "a") == (60, 5)


def test_the_ledger_keeps_a_row_per_replica_and_client():
    ledger = ServiceLedger(boot=5, full_every=3, idle_reports=3)
    ledger.received("r1", 0, "a", 10)
    ledger.received("r2", 1, "a", 5, interaction="i")
    with pytest.raises(ValueError, match="here already"):
        ledger.received("r1", 0, "a", 1)
    ledger.refused(0, "a", 1)  # the duplicate, refused here: its replica charged it
    ledger.sent("r2", 4)
    ledger.sent("unknown", 9)  # untagged: nothing
    report = ledger.report()
    assert report.full and report.boot == 5 and report.num_requests == 1
    assert sorted(report.rows) == [(0, "a", 11, 0, 1), (1, "a", 5, 4, 2)]
    assert report.requests == ((0, 1),) and report.interactions == ("i",)
    report = ledger.report()  # nothing changed: no rows
    assert not report.full and report.rows == () and report.interactions == ()
    ledger.sent("r1", 3)
    report = ledger.report()  # the third: a snapshot
    assert report.full and sorted(report.rows) == [(0, "a", 11, 3, 1), (1, "a", 5, 4, 2)]
    for _ in range(3):
        report = ledger.report()
    assert report.full and report.rows == () and ledger.num_rows == 0  # idle: forgotten
    ledger.received("r3", 1, "a", 6)
    assert ledger.report().rows == ((1, "a", 6, 0, 3),)  # born again
    ledger.want_full()
    assert ledger.report().full


def test_the_ledger_stays_bounded_under_one_shot_clients():
    """100,000 one-shot clients through two replicas: the rows, and each report, stay
    bounded by what was active within ``idle_reports`` reports."""
    ledger = ServiceLedger(boot=1, full_every=10, idle_reports=20)
    biggest = 0
    for k in range(1000):
        for j in range(100):
            rid = f"{k}-{j}"
            ledger.received(rid, j % 2, rid, 100)
            ledger.sent(rid, 10)
        report = ledger.report()
        biggest = max(biggest, len(report.rows))
    assert ledger.num_rows <= 100 * 31 and biggest <= 100 * 31


def _finished(worker: int, rid: str, client: str, n_out: int, t: float) -> Finished:
    return Finished(worker, t, rid, client, FinishReason.LENGTH, (1, 2, 3), (9,) * n_out)


def test_d2lpm_replicas_see_each_others_service_and_queues_through_reports():
    a = ReplicaRouter(make_router_policy("d2lpm"), 2, replica=0)
    b = ReplicaRouter(make_router_policy("d2lpm"), 2, replica=1)
    ledgers = [ServiceLedger(boot=1, full_every=1), ServiceLedger(boot=2, full_every=1)]
    req = Request(rid="r1", client="c", input_ids=tuple(range(40)), output_len=4, arrival_s=0.0)
    d = b.dispatch(req, 0.0)
    replica, charge = b.last_tag
    assert (replica, charge) == (1, 40)
    for r in (a, b):  # the first snapshots: baselines
        for u in range(2):
            r.handle(Load(u, 0.05, 0, 0, 0, 0, 100, service=ledgers[u].report()), 0.05)
    ledgers[d.worker].received("r1", replica, "c", charge)
    before = a.policy.deficit(d.worker, "c")
    load = Load(d.worker, 0.1, 1, 0, 0, 0, 100, service=ledgers[d.worker].report())
    a.handle(load, 0.1)
    assert a.policy.deficit(d.worker, "c") == before - 40  # w_e = 1
    assert a.queue_len(d.worker) == 1  # b's request, queued there
    b.handle(load, 0.1)
    assert b.queue_len(d.worker) == 1  # its own, not counted twice
    # b's request finishes with 4 tokens: a hears of them only from the next report.
    ledgers[d.worker].sent("r1", 4)
    b.handle(_finished(d.worker, "r1", "c", 4, 0.2), 0.2)
    load = Load(d.worker, 0.3, 0, 0, 0, 0, 100, service=ledgers[d.worker].report())
    for r in (a, b):
        r.handle(load, 0.3)
        assert r.queue_len(d.worker) == 0
        assert r.state.service(d.worker, "c") == (40, 4)
    assert a.policy.deficit(d.worker, "c") == before - 40 - 2 * 4  # w_o = 2


@pytest.mark.parametrize("deficits", ["sliding", "rounds"])
def test_a_client_first_seen_in_a_report_keeps_its_spread_over_the_workers(deficits):
    """Replica b first hears of client c from a's row on worker 0 (1,500 extend, past one
    quantum): c's next call through b leaves worker 0, though b's tree says it holds c's
    prefix. (With sliding deficits the worker c had no deficit on yet used to start level with
    the charged one, so the report's spread was lost and the call stayed on worker 0.)"""
    opts = {"quantum": 1000.0, "deficits": deficits}
    a = ReplicaRouter(make_router_policy("d2lpm", **opts), 2, replica=0)
    b = ReplicaRouter(make_router_policy("d2lpm", **opts), 2, replica=1)
    ledgers = [ServiceLedger(boot=1, full_every=1), ServiceLedger(boot=2, full_every=1)]
    for u in range(2):  # b's first snapshots: baselines
        b.handle(Load(u, 0.0, 0, 0, 0, 0, 100, service=ledgers[u].report()), 0.0)
    prefix = tuple(range(1500))
    first = Request(rid="r1", client="c", input_ids=prefix, output_len=4, arrival_s=0.1)
    d = a.dispatch(first, 0.1)
    ledgers[d.worker].received("r1", a.replica, "c", a.last_tag[1])
    ledgers[d.worker].sent("r1", 4)
    for u in range(2):
        b.handle(Load(u, 0.2, 0, 0, 0, 0, 100, service=ledgers[u].report()), 0.2)
    assert b.state.service(d.worker, "c") == (1500, 4)
    b.tree.insert(prefix, d.worker)  # as the worker's KV events tell b
    follow_up = Request(rid="r2", client="c", input_ids=(*prefix, 7), output_len=4, arrival_s=0.3)
    assert b.dispatch(follow_up, 0.3).worker != d.worker


def test_a_replicas_view_is_stale_by_at_most_one_period_and_never_ahead():
    """Two replicas and two workers, each worker reporting every ``period``; every message
    takes ``delay``. At every instant, replica 0's view of each (worker, client) holds all
    service it dispatched itself, all the other's up to ``period + 2 × delay`` ago, and
    nothing not yet charged."""
    rng = random.Random(7)
    period, delay = 0.1, 0.005
    ledgers = [ServiceLedger(boot=1), ServiceLedger(boot=2)]
    states = [ReplicaState(0), ReplicaState(1)]
    for r in range(2):
        for u in range(2):
            states[r].report(u, 0.0, ledgers[u].report())  # baselines (empty)
        ledgers[r].want_full()
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
            states[r].dispatched(u, client, charge)
            truth.append((t, r, u, client, charge))
            push(t + delay, "arrive", r, i, u, client, charge)
        elif what[0] == "arrive":
            _, r, i, u, client, charge = what
            ledgers[u].received(str(i), r, client, charge)
            push(t + rng.uniform(0.0, 0.3), "finish", r, u, client, i)
        elif what[0] == "finish":  # the worker sends Finished to its replica
            _, r, u, client, i = what
            out = rng.randint(1, 50)
            ledgers[u].sent(str(i), out)
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
    ledger.received("r", 3, "tenant-a", 120)
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
    replica_, charge = a.last_tag
    ledger.received("r1", replica_, "u", charge, interaction="agent-1")
    for r in (a, b):
        r.handle(report(0.2), 0.2)
    assert b.throttle(call("r2", "agent-1", 0.3), 0.3) is None  # mid-interaction: through
    assert b.throttle(call("r3", "agent-2", 0.3), 0.3) is not None  # a new one: refused
    # call 1 ends; its interaction is listed once more (its Finished went out since the last
    # report), then no more, and B keeps it for interaction_timeout_s like its own
    ledger.sent("r1", 4)
    b.handle(report(0.4), 0.4)
    assert "agent-1" not in ledger.report().interactions
    assert b.throttle(call("r4", "agent-1", 5.0), 5.0) is None
