"""``d2lpm-replicas``' fault rows (issue 40): router replicas through a worker restart, a
partition, a replica restart and duplicate rids, in the cluster simulator — no call lost or
hung, no view counting more than the workers' ledgers hold, and, with nothing injected, the
fault driver is the cluster simulator exactly."""

from __future__ import annotations

import pytest

from sgl_fair.experiment import cluster_runs
from sgl_fair.experiment.cluster_fault_events import FaultEvents
from sgl_fair.experiment.cluster_fault_sim import simulate_faults
from sgl_fair.experiment.cluster_replica_faults import (
    FAULTS,
    CountingLedger,
    FaultPlan,
    FaultReplicaSet,
)
from sgl_fair.experiment.cluster_replicas import _claims
from sgl_fair.experiment.cluster_runs import RunSpec, run_one
from sgl_fair.policies import make_policy
from sgl_fair.router import make_router_policy
from sgl_fair.worker.sim.cluster import ClusterConfig
from sgl_fair.workloads.combos import D2LPM
from sgl_fair.workloads.programs import generate_programs, workload

DUR = 3.0  # seconds of arrivals; the fault comes halfway
SMALL = RunSpec(D2LPM, 2, "tot", "s2", DUR, rate_scale=2.5)
WALL = {"sim_wall_s"}
CLEAN = {"calls_lost": 0, "calls_hung": 0, "inflight_leaked": 0}


def _run(kind: str, check_every: int = 31, **plan: object):
    """dp 2, R 2, ToT S2 for DUR s; every scheduler's and replica's invariants (views within
    the ledgers' truth) checked every ``check_every`` events and at the end."""
    clients = workload("tot", "s2", dp=2, num_clients=4, rate_scale=2.5, duration_s=DUR)
    plan = {"kind": kind, "at_s": DUR / 2, "worker": 1, "replica": 1, **plan}
    rset = FaultReplicaSet(
        lambda: make_router_policy("d2lpm"),
        2,
        2,
        plan=FaultPlan(**plan),  # type: ignore[arg-type]
    )
    programs = generate_programs(clients, DUR, seed=0)
    result = simulate_faults(
        router=rset,
        local_policy=lambda _w: make_policy("dlpm"),
        config=ClusterConfig(dp=2, report_period_s=0.1),
        programs=programs,
        until_s=200.0,
        check_every=check_every,
    )
    assert result.t_end_s < 200.0  # drained: nothing was left to happen
    return rset, result, rset.stats()


def _clean(stats: dict) -> None:
    assert {k: stats[k] for k in CLEAN} == CLEAN


@pytest.mark.parametrize("replicas", [1, 2])
def test_with_nothing_injected_the_fault_driver_is_the_cluster_simulator(monkeypatch, replicas):
    plain = run_one(SMALL)  # one router
    shared = run_one(SMALL.replace(replicas=replicas))
    never = FaultPlan("partition", 1e9, worker=1, replica=replicas - 1)  # a window never reached
    monkeypatch.setattr(cluster_runs, "fault_plan", lambda *_: never)
    faulty = run_one(SMALL.replace(replicas=replicas, fault="partition"))
    assert faulty["fault"] == "partition" and faulty["calls_hung"] == 0
    same = {k for k in shared if k not in WALL}
    diff = {k: (shared[k], faulty[k]) for k in same if shared[k] != faulty[k]}
    assert not diff
    if replicas == 1:  # one replica with shared state: one router, field for field
        diff = {k: (plain[k], faulty[k]) for k in plain if k not in WALL and plain[k] != faulty[k]}
        assert not diff
        assert faulty["view_lag_max"] == 0


def test_a_worker_restart_moves_or_fails_every_call_it_held():
    rset, result, stats = _run("worker-restart")
    _clean(stats)
    assert stats["worker_restarts"] == 1 and stats["worker_deaths_seen"] == 2  # both replicas
    assert stats["calls_failed"] > 0  # tokens had reached their clients
    assert stats["calls_failed"] + stats["calls_redispatched"] > 10
    assert result.unfinished == 0 and all(p.done for p in result.programs)
    new_boot = rset.boots[1][-1]
    assert rset.boots[1] == [2, new_boot]  # the old process's ledger is gone with it
    for s in range(2):  # each view of worker 1 follows the new boot, from a baseline snapshot
        assert rset.view_boot[s][1] == new_boot and rset.known_boot[s][1] == new_boot
        assert rset.replicas[s].state.num_baselines >= 3  # both workers at start, then this
    assert len(result.retired) == 1  # its service before the restart still counts


def test_without_redispatch_a_worker_restart_loses_calls(monkeypatch):
    """What the restart test guards against: a replica that forgets the worker's calls."""
    monkeypatch.setattr(FaultEvents, "_lost", lambda *_: None)
    _, _, stats = _run("worker-restart", check_every=0)
    assert stats["calls_lost"] > 0 and stats["calls_hung"] == stats["calls_lost"]


def test_a_partition_delays_one_replicas_view_and_loses_nothing():
    _, result, cut = _run("partition")
    _clean(cut)
    _, _, whole = _run("partition", check_every=0, at_s=1e9)  # a window never reached
    # 7 s without worker 1's reports at replica 1: its view lags far more than without
    assert cut["view_lag_max"] > 3 * whole["view_lag_max"]
    # shorter than both sides' timeouts: nobody declared dead, nothing aborted or moved
    assert cut["worker_deaths_seen"] == cut["requests_aborted_by_workers"] == 0
    assert cut["calls_redispatched"] == cut["calls_failed"] == cut["calls_retried"] == 0
    assert result.unfinished == 0 and all(p.done for p in result.programs)


def test_a_replica_restart_retries_its_calls_through_the_other_and_comes_back_new():
    rset, result, stats = _run("replica-restart")
    _clean(stats)
    assert stats["calls_retried"] > 0 and stats["requests_aborted_by_workers"] > 0
    assert rset.ids == [0, 2] and rset.ready == [True, True]  # a new id, taking calls again
    new = rset.replicas[1]
    assert sum(s.num_dispatched for s in new.stats.values()) > 0
    assert sorted(rset.view_boot[1]) == [0, 1]  # a baseline of each worker
    rows = {r for (u, _), totals in rset.ledgers.items() for c in totals.values() for r in c}
    assert rows == {0, 1, 2}  # the dead replica's rows stay: other replicas' service
    assert result.unfinished == 0 and all(p.done for p in result.programs)


def test_without_retries_a_replica_restart_loses_calls(monkeypatch):
    monkeypatch.setattr(FaultEvents, "_retry", lambda *_: None)  # the call just dropped
    _, _, stats = _run("replica-restart", check_every=0)
    assert stats["calls_lost"] > 0 and stats["calls_hung"] == stats["calls_lost"]


def test_a_duplicate_rid_is_refused_and_counted_once():
    rset, result, stats = _run("duplicate-rid", count=10, every_s=0.05)
    _clean(stats)
    assert stats["duplicates_sent"] == 10
    assert stats["calls_refused"] > 0
    assert stats["calls_refused"] + stats["duplicates_answered"] == stats["duplicates_sent"]
    assert result.unfinished == 0 and all(p.done for p in result.programs)
    # The run ended with a report after every Finished: each view is the ledgers' truth
    # exactly (within it, never above, is checked all along): nothing counted twice.
    for s, rep in enumerate(rset.replicas):
        for u in range(2):
            for c in rset.ledgers[(u, rset.view_boot[s][u])]:
                pe, po, oe, oo = rset._ledger_truth(s, u, c)
                assert rep.state.service(u, c) == (pe + oe, po + oo), (s, u, c)


def test_a_refusal_not_charged_to_its_replica_is_caught_as_a_double_count(monkeypatch):
    monkeypatch.setattr(CountingLedger, "refused", lambda *_: None)
    with pytest.raises(AssertionError, match="more than the ledgers hold"):
        _run("duplicate-rid", count=10, every_s=0.05)


def test_fault_claims_pass_on_clean_rows_and_fail_on_each_bad_outcome():
    base = {"scenario": "s2", "served_tok_s": 100.0, "jain": 0.80, "misbehaver_share": 0.4,
            "cache_hit_rate": 0.9, "view_lag_max": 1.0, "unfinished_calls": 0}  # fmt: skip
    rows = [
        {**base, "setup": "one router", "replicas": 1, "report_period_s": None},
        {**base, "setup": "shared", "replicas": 1, "report_period_s": 0.1},
        {**base, "setup": "shared", "replicas": 4, "report_period_s": 0.1},
    ]
    faults = [{**base, **CLEAN, "setup": "fault", "fault": f, "replicas": 4} for f in FAULTS]

    def verdicts(fault_rows):
        return {c.text: c.passed for c in _claims(rows + fault_rows) if "fault-free" in c.text
                or "lost or hung" in c.text}  # fmt: skip

    assert len(verdicts(faults)) == 2 * len(FAULTS) and all(verdicts(faults).values())
    for change in ({"calls_lost": 1}, {"calls_hung": 2}, {"inflight_leaked": 1}, {"jain": 0.76}):
        bad = verdicts([{**faults[0], **change}] + faults[1:])
        assert [t for t, ok in bad.items() if not ok] != [], change
    missing = verdicts(faults[1:])
    assert sum(not ok for ok in missing.values()) == 2  # a fault row filtered out fails
    alone = rows[2:] + faults  # no one-router row (a narrowed run): still judged
    assert len(verdicts(alone)) == 2 * len(FAULTS) and all(verdicts(alone).values())
    no_ref = {c.text: c.passed for c in _claims(faults) if "lost or hung" in c.text}
    assert len(no_ref) == len(FAULTS) and not any(no_ref.values())  # nothing to compare with
