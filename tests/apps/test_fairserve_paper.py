"""``fairserve-apps``'s ``paper`` scenario: the generator against the FairServe paper's Table 2,
Figure 1's bursts and Figure 2a's percentile limit (``apps/experiment/fairserve_paper.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_fair.experiment import fairserve
from sgl_fair.experiment.fairserve_paper import (
    TABLE2_BUCKETS,
    expected_size,
    figure1_levels,
    interaction_size,
    rpm_limit,
)


def shares(sizes: list[int]) -> list[float]:
    return [100 * np.mean([lo <= s <= hi for s in sizes]) for lo, hi, _ in TABLE2_BUCKETS]


def test_sizes_follow_table_2():
    rng = np.random.default_rng(7)
    sizes = [interaction_size(rng) for _ in range(20_000)]
    got = shares(sizes)
    # Binomial sd at n=20,000: 0.31 pts for 73 %, 0.05 for 0.5 %, 0.023 for 0.11 %.
    for (lo, hi, want), share, tol in zip(TABLE2_BUCKETS, got, (1.0, 1.0, 0.15, 0.08), strict=True):
        assert share == pytest.approx(want, abs=tol), (lo, hi, share)
    assert sum(got) == pytest.approx(100.0)  # nothing outside the table's rows
    assert min(sizes) == 1 and max(sizes) <= 30 and max(sizes) > 20
    assert {s for s in sizes if 2 <= s <= 10} == set(range(2, 11))  # uniform inside a bucket
    assert np.mean(sizes) == pytest.approx(expected_size(), rel=0.02)


def test_figure_1_shape_decompose_agents_aggregate():
    assert figure1_levels(1) == [1]
    assert figure1_levels(2) == [1, 1]
    assert figure1_levels(7) == [1, 5, 1]
    assert all(sum(figure1_levels(s)) == s for s in range(1, 31))
    with pytest.raises(ValueError):
        figure1_levels(0)


@pytest.fixture(scope="module")
def paper_interactions():
    users = fairserve.make_users(np.random.default_rng(0))
    return fairserve.make_interactions(users, fairserve.DURATION_S, 0, "paper")


def test_the_paper_scenarios_interactions_have_table_2s_sizes(paper_interactions):
    """Every app draws from Table 2 (~2,000 interactions in a full run: a wider tolerance)."""
    got = shares([sum(i.levels) for i in paper_interactions])
    assert got[0] == pytest.approx(73.22, abs=3.0)
    assert got[1] == pytest.approx(26.09, abs=3.0)
    for app in fairserve.APPS:  # not one app's shape: every app has single and multi calls
        sizes = {sum(i.levels) for i in paper_interactions if i.user.app is app}
        assert 1 in sizes and max(sizes) >= 5, app.name


def test_calls_burst_within_interactions_past_rpms_limit(paper_interactions):
    """A level's calls are issued together (closed loop, ``level_calls``): Figure 1's agents
    arrive as one burst, and a normal (benign) burst alone crosses rpm's derived limit."""
    limit = fairserve.benign_rpm_limit(paper_interactions, fairserve.DURATION_S)
    benign = [i for i in paper_interactions if not i.user.abusive]
    bursts = [max(i.levels) for i in benign]
    assert sum(b > 1 for b in bursts) > 0.1 * len(benign)
    assert sum(b > limit for b in bursts) > 0  # one burst is over the per-minute limit
    inter = next(i for i in benign if max(i.levels) > limit)
    fresh = fairserve._fresh(inter)
    fresh.level = fresh.levels.index(max(fresh.levels))
    calls = fairserve.level_calls(fresh, np.random.default_rng(0), 42.0)
    assert len(calls) == max(inter.levels) > limit
    assert {c.arrival_s for c in calls} == {42.0}
    assert {c.interaction_id for c in calls} == {inter.iid}


def test_rpm_limit_is_the_benign_users_99th_percentile(paper_interactions):
    # 100 users with 1..100 calls in one minute: the 99th percentile is 99.01 -> 100.
    assert rpm_limit(range(1, 101), 60.0) == 100
    assert rpm_limit([30] * 100, 600.0) == 3  # 3.0 per minute exactly: not rounded up
    assert rpm_limit([0, 0, 1], 600.0) == 1  # silent users are not in the CDF; at least 1
    with pytest.raises(ValueError):
        rpm_limit([0], 60.0)
    limit = fairserve.benign_rpm_limit(paper_interactions, fairserve.DURATION_S)
    per_user: dict[str, int] = {}
    for i in paper_interactions:
        if not i.user.abusive:
            per_user[i.user.name] = per_user.get(i.user.name, 0) + sum(i.levels)
    rates = np.array(list(per_user.values())) / (fairserve.DURATION_S / 60)
    assert (rates <= limit).mean() >= 0.99 and (rates <= limit - 1).mean() < 0.99
    # The abusive users are left out: their rates would put the 99th percentile far higher.
    flooded = paper_interactions + [
        fairserve.Interaction(f"x{k}", i.user, i.start_s, [30], ())
        for k, i in enumerate(paper_interactions)
        if i.user.abusive
    ]
    assert fairserve.benign_rpm_limit(flooded, fairserve.DURATION_S) == limit
    (rpm,) = [c for c in fairserve.policies(limit) if c.label == "rpm"]
    assert dict(rpm.options) == {"limit": limit}
    (rpm,) = [c for c in fairserve.policies() if c.label == "rpm"]
    assert dict(rpm.options) == {}  # today's scenarios: rpm's own default


def test_rpm_cuts_benign_bursts_mid_interaction():
    """rpm alone over the quick paper scenario, at its derived limit: benign users' bursts
    cross it, and the interactions are cut mid-way."""
    users = fairserve.make_users(np.random.default_rng(0))
    inters = fairserve.make_interactions(users, fairserve.QUICK_DURATION_S, 0, "paper")
    limit = fairserve.benign_rpm_limit(inters, fairserve.QUICK_DURATION_S)
    (case,) = [c for c in fairserve.policies(limit) if c.label == "rpm"]
    row = fairserve.run_case(case, inters, fairserve.QUICK_DURATION_S, 0, "paper")
    assert row["scenario"] == "paper" and row["policy"] == "rpm"
    assert row["benign_users_throttled"] > 0  # a burst over the limit, from a benign user
    assert row["benign_interactions_throttled"] > 0 and row["tokens_wasted"] > 0
