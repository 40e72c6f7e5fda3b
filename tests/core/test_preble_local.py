"""``preble-local``: Preble's local scheduler (hit-ratio priority groups, round-robin quotas).

Driven by hand like the other policies (``test_policies``' ``FakeView`` and ``admit_walk``),
then once through the real scheduler and once through the cluster simulator with Preble's
router, as the ``Preble`` pairing runs it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policies import FakeView, admit_walk, arrive, make_req

from sgl_fair.policies import make_policy, policy_names
from sgl_fair.policies.lpm import LPM
from sgl_fair.policies.preble_local import PrebleLocal, hit_group
from sgl_fair.request import Phase, Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cluster import ClusterConfig, simulate_cluster
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker
from sgl_fair.workloads.combos import PREBLE
from sgl_fair.workloads.programs import generate_programs, workload

N = 100  # prompt length of the hand-built requests: a prefix of k tokens is hit ratio k %


def reqs_with_hits(hits: dict[str, int]) -> tuple[list[Request], FakeView]:
    """Requests in the given (arrival) order, each with ``hits[rid]`` of N tokens cached."""
    reqs = [make_req(rid, rid[0], N, 4, float(i)) for i, rid in enumerate(hits)]
    return reqs, FakeView(hits)


def walk(policy, reqs: list[Request], view: FakeView, **kw) -> list[str]:
    waiting: list[Request] = []
    arrive(policy, reqs, waiting)
    return [r.rid for r in admit_walk(policy, waiting, view, **kw)]


# ------------------------------------------------------------------------ config, registry


def test_registered_with_the_papers_defaults():
    assert "preble-local" in policy_names()
    policy = make_policy("preble-local")
    assert isinstance(policy, PrebleLocal)
    assert (policy.config.groups, policy.config.quota_unit) == (10, 10)
    assert policy.cursor == 9  # the artifact's start_schedule_from
    assert [policy.quota(g) for g in (0, 4, 9)] == [10, 50, 100]
    assert PREBLE.local == "preble-local" and PREBLE.router == "preble"


@pytest.mark.parametrize(
    ("opts", "field"),
    [
        ({"groups": 0}, "groups"),
        ({"groups": -3}, "groups"),
        ({"groups": 2.5}, "groups"),
        ({"groups": True}, "groups"),
        ({"quota_unit": 0}, "quota_unit"),
        ({"quota_unit": "10"}, "quota_unit"),
        ({"quota_unit": 1.0}, "quota_unit"),
    ],
)
def test_bad_config_raises_naming_the_field(opts, field):
    with pytest.raises(ValueError, match=f"preble-local: {field} must be an integer >= 1"):
        make_policy("preble-local", **opts)


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="'preble-local' has no option 'quota'"):
        make_policy("preble-local", quota=3)


# ------------------------------------------------------------------------------ groups


@pytest.mark.parametrize(
    ("prefix", "tokens", "groups", "expected"),
    [
        (0, 100, 10, 0),
        (1, 100, 10, 0),
        (10, 100, 10, 0),  # h = 0.1 exactly: (0, 0.1] is group 0 (ceil(10 h) - 1)
        (11, 100, 10, 1),
        (50, 100, 10, 4),
        (51, 100, 10, 5),
        (99, 100, 10, 9),
        (100, 100, 10, 9),
        (7, 0, 10, 0),  # no tokens: h = 0
        (300, 100, 10, 9),  # clamped
        (1, 3, 3, 0),  # 1/3 exactly: no float rounding into group 1
        (2, 3, 3, 1),
        (99, 100, 1, 0),  # one group: FCFS
    ],
)
def test_hit_group(prefix, tokens, groups, expected):
    assert hit_group(prefix, tokens, groups) == expected


def test_group_uses_the_tokens_a_retracted_request_must_recompute():
    policy = PrebleLocal()
    req = make_req("r", "a", N, 50, 0.0)
    view = FakeView({"r": 60})
    assert policy.group_of(req, view) == 5
    req.output_ids.extend([7] * 50)  # retracted after 50 tokens: 150 tokens to re-prefill
    assert policy.group_of(req, view) == 3  # 60 / 150 = 0.4


def test_higher_hit_groups_first_and_arrival_order_inside_a_group():
    # Quotas larger than the queue: one round, each group drained in one turn.
    policy = PrebleLocal(PrebleLocal.Config(quota_unit=100))
    hits = {"a1": 5, "b1": 95, "c1": 45, "a2": 0, "b2": 91, "c2": 41, "d1": 100, "c3": 50}
    reqs, view = reqs_with_hits(hits)
    assert walk(policy, reqs, view) == ["b1", "b2", "d1", "c1", "c2", "c3", "a1", "a2"]
    # LPM orders by length inside a group instead (d1 and c3 first).
    lpm = [r.rid for r in LPM().order(reqs, view)]
    assert lpm == ["d1", "b1", "b2", "c3", "c1", "c2", "a1", "a2"]


# ------------------------------------------------------------------------------ quotas


def test_quotas_interleave_high_and_low_hit_requests():
    # Two groups, quota_unit 1: a turn of the high group (h > 0.5) takes 2, of the low 1.
    policy = PrebleLocal(PrebleLocal.Config(groups=2, quota_unit=1))
    hits = {"L1": 0, "L2": 10, "L3": 0, "H1": 90, "H2": 80, "H3": 95}
    reqs, view = reqs_with_hits(hits)
    order = walk(policy, reqs, view)
    assert order == ["H1", "H2", "L1", "H3", "L2", "L3"]
    assert order != [r.rid for r in LPM().order(reqs, view)]  # H3 H1 H2 L2 L1 L3
    assert order != list(hits)  # nor FCFS


def test_default_quotas_are_ten_per_priority_level():
    policy = PrebleLocal()  # groups 10, quota_unit 10: group 1 takes 20 a turn, group 0 ten
    hits = {f"H{i:02d}": 15 for i in range(25)} | {f"L{i:02d}": 0 for i in range(15)}
    reqs, view = reqs_with_hits(hits)
    order = [rid[0] for rid in walk(policy, reqs, view)]
    assert order == ["H"] * 20 + ["L"] * 10 + ["H"] * 5 + ["L"] * 5


def test_a_zero_hit_request_is_served_in_the_first_round():
    policy = PrebleLocal()  # the top group's turn is 100 requests
    hits = {f"H{i:03d}": 99 for i in range(200)} | {"zero": 0}
    reqs, view = reqs_with_hits(hits)
    order = walk(policy, reqs, view)
    assert order.index("zero") == 100  # right after the top group's first turn
    assert [r.rid for r in LPM().order(reqs, view)].index("zero") == 200  # LPM: last


# ------------------------------------------------------------------- round robin, cursor


def test_the_round_robin_position_persists_across_walks():
    policy = PrebleLocal(PrebleLocal.Config(groups=2, quota_unit=1))
    hits = {"L1": 0, "L2": 0, "H1": 90, "H2": 90, "H3": 90}
    reqs, view = reqs_with_hits(hits)
    waiting: list[Request] = []
    arrive(policy, reqs, waiting)
    admitted = []
    for _ in range(5):  # memory admits one request per step
        admitted += [r.rid for r in admit_walk(policy, waiting, view, limit=1)]
    # Each step is the next group's turn; a per-call restart would give H1 H2 H3 L1 L2.
    assert admitted == ["H1", "L1", "H2", "L2", "H3"]
    assert not waiting


def test_a_group_whose_head_does_not_fit_yields_its_turn():
    policy = PrebleLocal(PrebleLocal.Config(groups=2, quota_unit=1))
    reqs, view = reqs_with_hits({"L1": 0, "H1": 90})
    waiting: list[Request] = []
    arrive(policy, reqs, waiting)
    assert admit_walk(policy, waiting, view, limit=0) == []  # H1 offered, did not fit
    assert policy.cursor == 0
    assert [r.rid for r in admit_walk(policy, waiting, view)] == ["L1", "H1"]
    assert policy.cursor == 0  # the walk's last turn was group 1's: group 0 is next


def test_a_later_turn_of_a_walk_counts_once_it_admitted_a_request():
    policy = PrebleLocal(PrebleLocal.Config(groups=2, quota_unit=1))
    hits = {"H1": 90, "H2": 90, "H3": 90, "L1": 0, "L2": 0, "L3": 0}
    reqs, view = reqs_with_hits(hits)
    waiting: list[Request] = []
    arrive(policy, reqs, waiting)
    # H1 H2 (group 1's turn), L1 (group 0's), then H3 is offered and does not fit: the step
    # was full, so group 1 starts the next walk.
    assert [r.rid for r in admit_walk(policy, waiting, view, limit=3)] == ["H1", "H2", "L1"]
    assert policy.cursor == 1
    assert [r.rid for r in admit_walk(policy, waiting, view, limit=1)] == ["H3"]
    assert policy.cursor == 0


def test_an_admission_the_walk_is_not_resumed_after_still_takes_the_turn():
    # The scheduler closes the walk right after admitting a chunked prefill.
    policy = PrebleLocal(PrebleLocal.Config(groups=2, quota_unit=1))
    reqs, view = reqs_with_hits({"H1": 90, "L1": 0, "L2": 0})
    waiting: list[Request] = []
    arrive(policy, reqs, waiting)
    walk_ = policy.order(tuple(waiting), view)
    for expected in ("H1", "L1"):
        req = next(walk_)
        assert req.rid == expected
        policy.on_admitted(req, N)
    walk_.close()
    assert policy.cursor == 1  # group 0's turn (the walk's second) was taken


def test_the_cursor_skips_empty_groups_and_wraps():
    policy = PrebleLocal(PrebleLocal.Config(quota_unit=1))
    hits = {"g7a": 75, "g3a": 35, "g7b": 75, "g3b": 35, "g3c": 35, "g3d": 35, "g3e": 35}
    reqs, view = reqs_with_hits(hits)
    policy.cursor = 5
    # From 5 down: group 3 (quota 4), wrap to group 7 (quota 8), then group 3 again.
    assert walk(policy, reqs, view) == ["g3a", "g3b", "g3c", "g3d", "g7a", "g7b", "g3e"]
    assert policy.cursor == 2


def test_groups_are_recomputed_every_walk():
    policy = PrebleLocal(PrebleLocal.Config(groups=2, quota_unit=1))
    reqs, view = reqs_with_hits({"A": 0, "B": 0, "C": 0})
    waiting: list[Request] = []
    arrive(policy, reqs, waiting)
    assert [r.rid for r in admit_walk(policy, waiting, view, limit=1)] == ["A"]
    # C's prefix got cached meanwhile: it is in the high group now, and group 1 is next.
    assert policy.cursor == 1
    later = FakeView({"C": 90})
    assert [r.rid for r in admit_walk(policy, waiting, later)] == ["C", "B"]


@settings(max_examples=200, deadline=None)
@given(
    hits=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 60)), max_size=60),
    groups=st.integers(1, 12),
    quota_unit=st.integers(1, 4),
    cursor=st.integers(0, 11),
)
def test_order_yields_each_waiting_request_exactly_once(hits, groups, quota_unit, cursor):
    policy = PrebleLocal(PrebleLocal.Config(groups=groups, quota_unit=quota_unit))
    policy.cursor = cursor % groups
    reqs = [make_req(f"r{i}", "a", n, 1, float(i)) for i, (n, _) in enumerate(hits)]
    view = FakeView({r.rid: min(p, r.input_len) for r, (_, p) in zip(reqs, hits, strict=True)})
    order = list(policy.order(tuple(reqs), view))
    assert sorted(map(id, order)) == sorted(map(id, reqs))
    assert len(order) == len(reqs)
    by_group: dict[int, list[Request]] = {}
    for r in order:
        by_group.setdefault(policy.group_of(r, view), []).append(r)
    for members in by_group.values():  # arrival order inside every group
        assert [r.arrival_s for r in members] == sorted(r.arrival_s for r in members)
    if reqs:  # the first turn is the first non-empty group at or below the cursor
        nonempty = sorted(by_group, reverse=True)
        start = next((g for g in nonempty if g <= cursor % groups), nonempty[0])
        assert policy.group_of(order[0], view) == start


# ------------------------------------------------------------------- the real scheduler


def test_the_real_scheduler_admits_in_the_policys_order():
    policy = make_policy("preble-local", groups=2, quota_unit=1)
    sched, engine = make_sim_worker(
        policy=policy,
        cost_model=CostModel.from_names("A10G", "Llama-2-7B"),
        kv_tokens=20_000,
        config=SchedulerConfig(chunked_prefill_size=8192, max_running_requests=64),
    )
    shared = tuple(range(10_000, 10_090))

    def req(rid: str, ids: tuple[int, ...], t: float) -> Request:
        return Request(rid, rid[0], ids, 2, t)

    now = 0.0
    warm = req("W", shared + (1,) * 10, 0.0)  # puts the shared 90 tokens in the cache
    sched.add_request(warm, now)
    while sched.has_work():
        batch = sched.step(now)
        result = engine.run(batch)
        now += result.duration_s
        sched.apply(result, now)
    assert warm.phase is Phase.FINISHED and policy.cursor == 1  # group 0's turn was taken
    lows = [req(f"L{i}", tuple(range(20_000 + 100 * i, 20_100 + 100 * i)), now) for i in range(3)]
    highs = [req(f"H{i}", shared + (50 + i,) * 10, now) for i in range(3)]
    for r in lows + highs:  # the low-hit requests arrive first
        sched.add_request(r, now)
    batch = sched.step(now)
    assert [c.req.rid for c in batch.prefill] == ["H0", "H1", "L0", "H2", "L1", "L2"]
    assert [c.start for c in batch.prefill][:2] == [90, 90]  # the hits were real


def test_preble_router_over_preble_local_drains_a_cluster():
    clients = workload("tot", "s2", dp=2, num_clients=3, duration_s=15.0)
    programs = generate_programs(clients, 15.0, seed=1)
    router = Router(make_router_policy(PREBLE.router), 2)
    res = simulate_cluster(
        router=router,
        local_policy=lambda _w: make_policy(PREBLE.local),
        config=ClusterConfig(
            dp=2,
            gpu="A10G-24GB",
            model="Llama-3.2-3B",
            kv_tokens=6000,
            scheduler=SchedulerConfig(max_running_requests=64),
        ),
        programs=programs,
        check_every=50,
    )
    assert res.unfinished == 0 and all(p.done for p in programs)
    assert all(r.phase is Phase.FINISHED for r in res.submitted)
    assert any(r.first_prefix_len for r in res.submitted)  # prefixes were reused
    router.check_invariants()
