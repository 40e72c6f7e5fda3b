"""``fairserve-apps`` in quick mode: the default (``paper``) scenario through the command line,
today's two scenarios through ``run`` (one run each, shared by the tests).

What must hold by construction is asserted; the issue's performance targets are reported in
the run's ``claims`` (docs/fairserve.md records them) and are not asserted here.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from sgl_fair.experiment import fairserve
from sgl_fair.experiment.cli import main

FIELDS = (
    "policy",
    "tokens_wasted",
    "interactions_throttled",
    "benign_users_throttled",
    "abusive_users_throttled",
    "users_served_pct",
    "users_queued_pct",
    "queue_delay_p99_s",
    "ttft_p50_s",
    "throughput_tok_s",
    "served_overloaded_tok_s",
    "served_underloaded_tok_s",
    "computed_overloaded_tok_s",
)


TODAY = ("benign-overload", "abuse-overload")


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    out = tmp_path_factory.mktemp("fairserve")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["run", "fairserve-apps", "--quick", "--json", "--out", str(out)])
    assert rc == 0
    data = json.loads(buf.getvalue())
    assert json.loads((out / "results.json").read_text()) == data
    return data


@pytest.fixture(scope="module")
def result():
    return fairserve.run(quick=True, scenarios=TODAY)


@pytest.fixture(scope="module")
def every_row(paper, result):
    return paper["rows"] + result["rows"]


def test_the_workload_has_the_issues_shape():
    users = fairserve.make_users(np.random.default_rng(0))
    assert len(users) >= 1000
    assert len({u.app.name for u in users}) >= 4
    assert 0 < sum(u.abusive for u in users) <= 0.01 * len(users)
    inters = fairserve.make_interactions(users, fairserve.QUICK_DURATION_S, 0)
    sizes = {a.name: {sum(i.levels) for i in inters if i.user.app is a} for a in fairserve.APPS}
    assert sizes["chat"] == {1}
    assert min(sizes["agent"]) >= 3 and max(sizes["agent"]) <= 10
    assert min(sizes["tot"]) >= 4 and min(sizes["judge"]) >= 3


def scenario_rows(rows, scenario):
    return {r["policy"]: r for r in rows if r["scenario"] == scenario}


def test_the_default_scenario_is_the_papers(paper):
    assert [r["scenario"] for r in paper["rows"]] == ["paper"] * 4
    assert {c["scenario"] for c in paper["claims"]} == {"paper"}
    assert all("paper" in c and "(paper: " in c["detail"] for c in paper["claims"])
    assert list(paper["scenarios"]) == ["paper"]
    users = fairserve.make_users(np.random.default_rng(0))
    inters = fairserve.make_interactions(users, fairserve.QUICK_DURATION_S, 0, "paper")
    limit = fairserve.benign_rpm_limit(inters, fairserve.QUICK_DURATION_S)
    assert paper["scenarios"]["paper"]["rpm_limit_per_min"] == limit
    assert result_limits(paper) == {"paper": limit}


def result_limits(data):
    return {k: v["rpm_limit_per_min"] for k, v in data["scenarios"].items()}


def test_rows_carry_every_field_for_every_policy_and_scenario(result, every_row):
    assert [r["scenario"] for r in result["rows"]] == [s for s in TODAY for _ in range(4)]
    for scenario in fairserve.SCENARIOS:
        rows = scenario_rows(every_row, scenario)
        assert list(rows) == ["rpm", "vtc", "fairserve-w", "fairserve"]
        for row in rows.values():
            assert set(FIELDS) <= set(row), set(FIELDS) - set(row)
    assert result["quick"] and result["duration_s"] == fairserve.QUICK_DURATION_S
    assert result["claims"] and all(
        {"scenario", "text", "passed", "detail"} <= set(c) for c in result["claims"]
    )
    assert {c["scenario"] for c in result["claims"]} == set(TODAY)
    assert result_limits(result) == {s: 20 for s in TODAY}  # rpm's own default there


def test_each_scenario_has_the_load_it_claims(result):
    """Offered vs served: both scenarios are overloaded for every policy in their first half;
    in abuse-overload the benign users alone would fit. Seed 0, quick: deterministic."""
    offered = result["offered"]
    assert set(offered) == set(TODAY)
    assert (
        offered["abuse-overload"]["overloaded_benign_tok_s"]
        < offered["benign-overload"]["overloaded_benign_tok_s"]
    )
    for o in offered.values():  # the underloaded phase is lighter than the overloaded one
        assert o["underloaded_benign_tok_s"] < o["overloaded_benign_tok_s"]
    assert len(result["premises"]) == 3
    assert all(p["passed"] for p in result["premises"]), result["premises"]


def test_offered_load_counts_expected_tokens_per_phase():
    user = fairserve.User("u", fairserve.APPS[0], 1.0, abusive=True)
    app = user.app
    per_call = sum(app.input_len) / 2 + app.system_len + sum(app.output_len) / 2
    inters = [
        fairserve.Interaction("a", user, 1.0, [1], ()),
        fairserve.Interaction("b", user, 15.0, [2, 1], ()),
    ]
    got = fairserve.offered_load(inters, 20.0)
    assert got["overloaded_abusive_tok_s"] == round(per_call / 10, 1)
    assert got["underloaded_abusive_tok_s"] == round(3 * per_call / 10, 1)
    assert got["overloaded_benign_tok_s"] == got["underloaded_benign_tok_s"] == 0


@pytest.mark.parametrize("scenario", list(fairserve.SCENARIOS))
def test_what_holds_by_construction(every_row, scenario):
    rows = scenario_rows(every_row, scenario)
    fs = rows["fairserve"]
    assert fs["tokens_wasted"] == 0  # OIT never throttles mid-interaction
    assert fs["throttled_while_underloaded"] == 0
    for name in ("vtc", "fairserve-w"):  # no admission control: nothing throttled
        assert rows[name]["interactions_throttled"] == 0 and rows[name]["tokens_wasted"] == 0
    assert rows["rpm"]["tokens_wasted"] > 0  # RPM cuts interactions in half
    assert fs["abusive_users_throttled"] > 0
    for row in rows.values():
        assert 0 <= row["users_served_pct"] <= 100 and 0 <= row["users_queued_pct"] <= 100
        assert row["throughput_tok_s"] > 0
        served = row["served_overloaded_tok_s"] + row["served_underloaded_tok_s"]
        assert served / 2 == pytest.approx(row["throughput_tok_s"], abs=0.1)


def test_list_names_the_experiment(capsys):
    assert main(["list"]) == 0
    assert "fairserve-apps" in capsys.readouterr().out


def test_cluster_flags_are_refused(capsys):
    assert main(["run", "fairserve-apps", "--quick", "--router", "rr"]) == 2
    assert "--router" in capsys.readouterr().err
    assert main(["run", "fairserve-apps", "--quick", "--dp", "0"]) == 2
    assert "--dp" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["s1", "none", "Paper", ""])
def test_a_bad_scenario_is_one_line_exit_2(capsys, bad):
    assert main(["run", "fairserve-apps", "--quick", "--scenario", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--scenario" in err and "paper" in err, err
    assert "benign-overload" in err and "abuse-overload" in err


def test_the_cluster_experiments_keep_their_scenarios(capsys):
    """``--scenario paper`` is fairserve-apps's; a cluster experiment still wants s1|s2|none."""
    from sgl_fair.experiment.cluster import EXPERIMENTS

    name = next(iter(EXPERIMENTS))
    assert main(["run", name, "--quick", "--scenario", "paper"]) == 2
    assert "s1, s2 or none" in capsys.readouterr().err


def test_over_a_cluster_the_router_throttles_the_abusers_only():
    """``--dp 2``: two copies of the users behind the router; fairserve's OIT runs at the
    router over the cluster's load and throttles abusers only, wasting nothing; vtc throttles
    nobody. 150 s of the benign-overload scenario (overload builds by then).

    Before ``Request.oit_checked``, the workers' own OIT also refused calls the router had let
    through: one call of a judge fan-out on a worker that never saw the others, so the rest of
    the interaction ran for nothing (31,421 tokens wasted here)."""
    from sgl_fair.experiment.fairserve_cluster import run_case_cluster, scaled_users

    users = scaled_users(fairserve.make_users(np.random.default_rng(0)), 2)
    inters = fairserve.make_interactions(users, 150.0, 0, "benign-overload")
    cases = {c.label: c for c in fairserve.policies()}
    vtc = run_case_cluster(cases["vtc"], inters, 150.0, 0, 2, "benign-overload")
    fs = run_case_cluster(cases["fairserve"], inters, 150.0, 0, 2, "benign-overload")
    assert vtc["dp"] == fs["dp"] == 2 and vtc["router"] == "d2lpm"
    assert vtc["interactions_throttled"] == vtc["router_throttled"] == 0
    # Every refusal is the router's: each throttled interaction had at least one call refused.
    assert fs["router_throttled"] >= fs["interactions_throttled"] > 0
    assert len(users) == 2 * fairserve.NUM_USERS
    assert fs["abusive_users_throttled"] == fs["abusive_throttled_in_overload"] >= 6
    assert fs["benign_users_throttled"] == 0 and fs["tokens_wasted"] == 0
    assert all(k in fs for k in FIELDS[:-1])  # computed_* is the single-worker run's only


def test_queueing_delay_is_the_schedulers_queue_time():
    """A call retracted and re-queued counts every wait (``Request.queue_s``, what the server
    reports as meta_info.queue_time), not just arrival -> first admission; a call still
    waiting counts until the end of the run."""
    from sgl_fair.request import Phase, Request

    user = fairserve.User("u", fairserve.APPS[0], 1.0, abusive=False)
    inter = fairserve.Interaction("i", user, 0.0, [2], ())
    requeued = Request("a", "u", (1, 2), 4, 0.0)
    requeued.phase, requeued.admit_s, requeued.queue_s = Phase.RUNNING, 0.5, 1.5
    waiting = Request("b", "u", (1, 2), 4, 9.5)
    waiting.queued_s = 9.5
    inter.calls = [requeued, waiting]
    row = fairserve.make_row("vtc", [inter], [], 10.0, 0.0)
    assert row["users_queued_pct"] == 100.0  # 1.5 s > 1 s, though admitted after 0.5 s
    assert row["queue_delay_p99_s"] == pytest.approx(1.5 - 0.01 * (1.5 - 0.5), abs=1e-3)
    assert row["queue_delay_p50_s"] == pytest.approx(1.0)  # median of 1.5 and 0.5
