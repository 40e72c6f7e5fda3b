"""``d2lpm-replicas`` (issue 34): router replicas in the cluster simulator — one replica with
shared state is one router exactly; R replicas' views stay behind the truth, never ahead."""

from __future__ import annotations

from sgl_fair.experiment.cluster import EXPERIMENTS, Overrides, apply_overrides
from sgl_fair.experiment.cluster_replica_faults import FAULTS
from sgl_fair.experiment.cluster_replica_set import ReplicaSet
from sgl_fair.experiment.cluster_runs import RunSpec, run_one
from sgl_fair.policies import make_policy
from sgl_fair.router import make_router_policy
from sgl_fair.worker.sim.cluster import ClusterConfig, simulate_cluster
from sgl_fair.workloads.combos import D2LPM
from sgl_fair.workloads.programs import generate_programs, workload

SMALL = RunSpec(D2LPM, 2, "tot", "s2", 1.0, rate_scale=2.5)
WALL = {"sim_wall_s"}
REPLICA_FIELDS = {"replicas", "report_period_s", "shared_state", "misbehaver_share"}


def test_registered_with_every_setup_and_overrides_keep_them_apart():
    exp = EXPERIMENTS["d2lpm-replicas"]
    specs = exp.build(True, 0)
    shared = {(s.replicas, s.report_period_s) for s in specs if s.replicas and s.shared_state}
    assert {1, 2, 4, 8} == {r for r, _ in shared}
    assert {0.01, 0.1, 0.5} == {p for r, p in shared if r == 4}
    assert {s.replicas for s in specs if s.replicas and not s.shared_state} == {2, 4, 8}
    assert sum(s.replicas is None for s in specs) == 2  # one plain router per scenario
    assert {s.scenario for s in specs} == {"s1", "s2"}
    assert {s.dp for s in specs} == {4} and {s.workload for s in specs} == {"tot"}
    assert len(apply_overrides(specs, Overrides(dp=4))) == len(specs)
    s1 = apply_overrides(specs, Overrides(scenario="s1"))
    assert s1 == [s for s in specs if s.scenario == "s1"]
    full = exp.build(False, 0)
    assert {s.scenario for s in full} == {"s1", "s2"}
    assert {(s.replicas, s.report_period_s) for s in full if s.shared_state and s.replicas} == (
        {(1, 0.1)} | {(r, p) for r in (2, 4, 8) for p in (0.01, 0.1, 0.5)}
    )
    for build in (specs, full):  # issue 40: each fault once per scenario, at R = 4, 100 ms
        faults = [s for s in build if s.fault is not None]
        assert sorted((s.scenario, s.fault) for s in faults) == sorted(
            (sc, f) for sc in ("s1", "s2") for f in FAULTS
        )
        assert {(s.replicas, s.report_period_s, s.shared_state) for s in faults} == {(4, 0.1, True)}
        assert all(s.row_extra["setup"] == "fault" for s in faults)
        assert all(s.row_extra["setup"] != "fault" for s in build if s.fault is None)
    assert {s.fault for s in apply_overrides(full, Overrides(dp=4))} == {None, *FAULTS}


def test_one_replica_with_shared_state_is_one_router_exactly():
    plain = run_one(SMALL)
    one = run_one(SMALL.replace(replicas=1, report_period_s=0.01))
    assert set(one) >= REPLICA_FIELDS
    assert one["replicas"] == 1 and one["shared_state"] is True and one["view_lag_max"] == 0
    assert one["num_reports"] > 0  # the reports flowed; they added nothing
    diff = {k for k in plain if k not in WALL and plain[k] != one[k]}
    assert not diff, {k: (plain[k], one[k]) for k in diff}


def test_replicas_views_lag_the_truth_and_independent_ones_lag_more():
    clients = workload("tot", "s2", dp=2, num_clients=4, rate_scale=2.5, duration_s=1.0)
    rows = {}
    for shared in (True, False):
        router = ReplicaSet(
            lambda: make_router_policy("d2lpm"), 2, 2, shared=shared, kv_event_delay_s=0.001
        )
        simulate_cluster(
            router=router,
            local_policy=lambda _w: make_policy("dlpm"),
            config=ClusterConfig(dp=2, report_period_s=0.1 if shared else None),
            programs=generate_programs(clients, 1.0, seed=0),
            until_s=20.0,
            check_every=97,  # every replica's view <= the truth, its own never lost
        )
        rows[shared] = router.stats()
        assert rows[shared]["replica_dispatches"][0] > 0 < rows[shared]["replica_dispatches"][1]
    assert 0 < rows[True]["view_lag_max"] < rows[False]["view_lag_max"]
    assert rows[True]["num_reports"] > 0 == rows[False]["num_reports"]
