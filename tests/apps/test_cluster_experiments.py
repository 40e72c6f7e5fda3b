"""Cluster experiments: the registry, CLI flags (overrides), rows, claims and outputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from sgl_fair.experiment import main
from sgl_fair.experiment.cluster import (
    EXPERIMENTS,
    Overrides,
    apply_overrides,
    run_cluster_experiment,
)
from sgl_fair.experiment.cluster_runs import RunSpec, run_one
from sgl_fair.workloads.combos import D2LPM, RR_LPM

ROW_FIELDS = {
    "router",
    "local",
    "dp",
    "workload",
    "scenario",
    "p50_well_behaved_s",
    "p99_well_behaved_s",
    "throughput_tok_s",
    "offered_tok_s",
    "served_tok_s",
    "jain",
    "jain_actual",
    "cache_hit_rate",
}


def test_every_paper_figure_is_registered():
    names = {"dlpm-quantum", "d2lpm-grid", "d2lpm-timeline", "d2lpm-quantum"}
    names |= {"dlpm-clients", "dlpm-mixed", "chat-flood", "cluster"}
    assert names <= set(EXPERIMENTS)


def test_grid_covers_workloads_scenarios_dps_and_pairings():
    specs = EXPERIMENTS["d2lpm-grid"].build(True, 0)
    assert {s.workload for s in specs} == {"tot", "judge", "longqa"}
    assert {s.scenario for s in specs} == {"s1", "s2"}
    assert {s.dp for s in specs} == {1, 2, 4, 8}
    assert {s.combo.label for s in specs if s.dp == 4} == {
        "D2LPM",
        "D2LPM-paper",  # the paper's setting beside the defaults (issue 31)
        "RR+LPM",
        "Preble",
        "VTC",
        "CacheAware+LPM",
    }
    paper = {s.combo.router_opts.get("deficits") for s in specs if s.combo.label == "D2LPM-paper"}
    assert paper == {"rounds"} and all(
        s.combo.router_opts["quantum"] == 10_000 for s in specs if s.combo.label == "D2LPM-paper"
    )
    assert 1 not in {s.dp for s in specs if s.combo.label == "D2LPM-paper"}  # routing is moot
    # Quick keeps the number of programs per run: dp × duration is constant.
    assert len({s.dp * s.duration_s for s in specs}) == 1


def test_overrides_select_a_slice_or_make_a_pairing():
    specs = EXPERIMENTS["d2lpm-grid"].build(True, 0)
    sliced = apply_overrides(specs, Overrides(dp=4, workload="tot", scenario="s2"))
    assert len(sliced) == 6 and {(s.dp, s.workload, s.scenario) for s in sliced} == {
        (4, "tot", "s2")
    }
    only = apply_overrides(sliced, Overrides(router="d2lpm"))
    assert [s.combo.label for s in only] == ["D2LPM", "D2LPM-paper"]
    custom = apply_overrides(sliced, Overrides(router="least-load", local="vtc"))
    assert len(custom) == 1 and (custom[0].combo.router, custom[0].combo.local) == (
        "least-load",
        "vtc",
    )


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_a_dp_slice_of_the_grid_is_the_grid_at_that_dp(dp):
    """``--dp N`` on the whole grid runs each pairing as the grid's own dp-N cell: the same
    durations for every pairing of a cell (before, D2LPM, RR+LPM and VTC kept the dp-1 spec's
    60 s while the pairings absent at dp 1 ran 60/N s), and the same specs as slicing the cell."""
    specs = EXPERIMENTS["d2lpm-grid"].build(True, 0)
    got = apply_overrides(specs, Overrides(dp=dp))
    want = [s for s in specs if s.dp == dp]
    assert sorted(got, key=repr) == sorted(want, key=repr)
    for wl in ("tot", "judge", "longqa"):
        cell = apply_overrides(specs, Overrides(dp=dp, workload=wl, scenario="s1"))
        assert len({s.duration_s for s in cell}) == 1, {s.combo.label: s.duration_s for s in cell}
        assert cell == [s for s in want if s.workload == wl and s.scenario == "s1"]


def test_one_run_row_has_the_issue_fields_and_sane_values():
    row = run_one(RunSpec(D2LPM, 2, "judge", "s1", 8.0, gpu="A10G-24GB", model="Llama-3.2-3B"))
    assert set(row) >= ROW_FIELDS
    assert row["router"] == "d2lpm" and row["local"] == "dlpm" and row["dp"] == 2
    assert row["misbehaving"] == ["c0"]
    assert row["unfinished_calls"] == 0 and row["num_calls"] > 0
    assert 0 < row["jain"] <= 1 and 0 <= row["cache_hit_rate"] <= 1
    assert row["p99_well_behaved_s"] >= row["p50_well_behaved_s"] > 0
    assert sum(row["dispatch_counts"]) == row["num_calls"]
    json.dumps(row)  # JSON-able


def test_longqa_reports_ttft_not_program_latency():
    spec = RunSpec(RR_LPM, 1, "longqa", "s2", 15.0, gpu="A10G-24GB", model="Llama-3.2-3B")
    row = run_one(spec)
    # A long-document QA program is several calls; its TTFT is far below its e2e latency.
    assert row["p50_well_behaved_s"] <= row["ttft_p99_s"] + 1e-9


def test_claims_are_evaluated_and_can_fail():
    exp = EXPERIMENTS["d2lpm-quantum"]
    rows = [
        {"policy": "D2LPM", "x": 2000.0, "throughput_tok_s": 100.0, "jain": 0.9},
        {"policy": "D2LPM", "x": math.inf, "throughput_tok_s": 150.0, "jain": 0.7},
    ]
    claims = exp.claims(rows)
    assert [c.passed for c in claims] == [True, True, False]  # ∞ beat the finite quantum
    rows[1]["throughput_tok_s"] = 50.0
    assert [c.passed for c in exp.claims(rows)] == [False, True, True]


def test_run_cluster_experiment_end_to_end(tmp_path):
    out = tmp_path / "grid"
    rc = main(
        [
            "run", "d2lpm-grid", "--quick", "--dp", "2", "--workload", "judge",
            "--scenario", "s1", "--gpu", "A10G-24GB", "--model", "Llama-3.2-3B",
            "--jobs", "1", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert len(data["rows"]) == 6 and all(r["dp"] == 2 for r in data["rows"])  # D2LPM twice
    assert {r["gpu"] for r in data["rows"]} == {"A10G-24GB"}
    assert data["claims"] and (out / "grid.png").stat().st_size > 0
    assert "## Claims" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "d2lpm-grid", "--dp", "0"], "--dp"),
        (["run", "d2lpm-grid", "--router", "nope"], "--router"),
        (["run", "d2lpm-grid", "--local", "nope"], "--local"),
        (["run", "d2lpm-grid", "--workload", "nope"], "--workload"),
        (["run", "d2lpm-grid", "--scenario", "s9"], "--scenario"),
        (["run", "d2lpm-grid", "--gpu", "TPU"], "TPU"),
        (["run", "vtc-overload", "--dp", "2"], "only for cluster experiments"),
        (["run", "no-such-experiment"], "unknown experiment"),
    ],
)
def test_bad_flags_are_one_line_exit_2(argv, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_fair.experiment", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert needle in proc.stderr


def test_run_cluster_experiment_api_without_processes():
    exp = EXPERIMENTS["cluster"]
    res = run_cluster_experiment(
        exp, quick=True, overrides=Overrides(dp=2, workload="chat", gpu="A10G-24GB"), jobs=1
    )
    assert len(res.rows) == 1 and res.rows[0]["workload"] == "chat"
    assert res.to_json()["all_claims_passed"] is None  # no claims: nothing was checked


def _clients(c0: float, c1: float) -> dict:
    return {"c0": {"service_rate": c0}, "c1": {"service_rate": c1}}


def _grid_cell(**d2lpm):
    """One fabricated tot-s2 dp=2 cell: D2LPM passes every grid claim unless overridden."""
    base = {"workload": "tot", "scenario": "s2", "dp": 2, "offered_tok_s": 200.0,
            "misbehaving": ["c0"]}  # fmt: skip
    d2lpm.setdefault("clients", _clients(80.0, 30.0))
    rows = [
        {**base, "policy": "VTC", "served_tok_s": 50.0, "jain": 0.95, "p99_well_behaved_s": 40.0,
         "clients": _clients(25.0, 25.0), "jain_actual": 0.99},  # fmt: skip
        {**base, "policy": "RR+LPM", "served_tok_s": 90.0, "jain": 0.7, "p99_well_behaved_s": 60},
        {**base, "policy": "Preble", "served_tok_s": 100.0, "jain": 0.7, "p99_well_behaved_s": 30},
        {**base, "policy": "CacheAware+LPM", "served_tok_s": 95.0, "jain": 0.7,
         "p99_well_behaved_s": 50.0},
        {**base, "policy": "D2LPM", "served_tok_s": 110.0, "jain": 0.93, "p99_well_behaved_s": 9.0,
         "jain_actual": 0.97, **d2lpm},
    ]  # fmt: skip
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


@pytest.mark.parametrize(
    "change,failing",
    [
        ({}, set()),
        ({"served_tok_s": 190.0}, {0}),  # the best system serves 95 % of the offer
        ({"served_tok_s": 94.0}, {2, 3}),  # < 2x VTC, < 0.95x Preble
        ({"served_tok_s": 40.0}, {1, 2, 3}),
        ({"jain": 0.91}, {4}),  # more than 0.03 below VTC
        ({"p99_well_behaved_s": 12.0}, {6}),  # better than Preble, not 3x
        ({"p99_well_behaved_s": 31.0}, {5, 6}),
        ({"clients": _clients(90.0, 23.0)}, {7}),  # c1 (well-behaved) < 0.95x its VTC rate
        ({"clients": _clients(20.0, 25.0)}, set()),  # the misbehaver's rate is not checked
        ({"jain_actual": 0.95}, {8}),  # the system view, more than 0.03 below VTC's
    ],
)
def test_grid_claims_are_the_issues_targets_and_can_fail(change, failing):
    claims = EXPERIMENTS["d2lpm-grid"].claims(_grid_cell(**change))
    assert len(claims) == 9
    assert {i for i, c in enumerate(claims) if not c.passed} == failing, claims


def test_a_scenario_override_selects_its_runs_with_their_own_rates():
    """``--scenario s2`` on an experiment with S1 and S2 runs (d2lpm-replicas: S2 is S1's
    clients at x2.5) keeps the S2 runs as built. Before, it set "s2" on the S1 runs too (S2 at
    S1's rate) and dropped the real ones as their duplicates (the key had no rate)."""
    specs = EXPERIMENTS["d2lpm-replicas"].build(False, 0)
    got = apply_overrides(specs, Overrides(scenario="s2"))
    want = [s for s in specs if s.scenario == "s2"]
    assert got == want and {s.rate_scale for s in got} == {s.rate_scale for s in want}
    assert all(s.rate_scale != 1.0 for s in got)
    # a scenario no run has is set on all (a fixed setting changed)
    chat = apply_overrides(EXPERIMENTS["d2lpm-grid"].build(True, 0), Overrides(scenario="none"))
    assert {s.scenario for s in chat} == {None}


def test_the_well_behaved_claim_never_rounds_a_miss_up_to_its_bound():
    """A client at 0.948× its VTC rate fails the ≥ 0.95× claim, and the detail says 0.948:
    printed to two places it read "min 0.95" beside a FAIL (the quick grid, 2026-11-29)."""
    from sgl_fair.experiment.cluster_grid import _well_behaved_claim

    def row(policy, rate):
        return {"workload": "tot", "scenario": "s1", "dp": 2, "policy": policy,
                "misbehaving": ["c0"], "clients": {"c0": {"service_rate": 9.0},
                                                   "c3": {"service_rate": rate}}}  # fmt: skip

    bad = _well_behaved_claim([row("D2LPM", 0.948), row("VTC", 1.0)])
    assert not bad.passed and "min 0.948" in bad.detail and "c3: 0.948" in bad.detail
    good = _well_behaved_claim([row("D2LPM", 0.95), row("VTC", 1.0)])
    assert good.passed and good.detail == "1/1 clients; min 0.950"
