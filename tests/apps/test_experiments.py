"""The paper-figure experiments in quick mode: the regression net for every claim.

Each experiment is simulated once per module (``quick_result``) and shared by the tests.
A claim that cannot fail proves nothing, so every experiment's claims are also
evaluated with the fair policy's run swapped for the unfair one's: they must then fail.
"""

from __future__ import annotations

import json

import pytest

from sgl_fair.experiment.single import ExperimentResult, run_experiment
from sgl_fair.experiment.vtc import EXPERIMENTS, get_experiment


@pytest.fixture(scope="module")
def quick_result():
    cache: dict[str, ExperimentResult] = {}

    def get(name: str) -> ExperimentResult:
        if name not in cache:
            cache[name] = run_experiment(get_experiment(name), quick=True, seed=0)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_claim_holds_in_quick_mode(quick_result, name):
    result = quick_result(name)
    exp = result.experiment
    assert result.duration_s == exp.quick_duration_s
    assert list(result.runs) == [p.label for p in exp.policies]
    assert result.claims, f"{name} checks nothing"
    failed = [f"{c.text} [{c.detail}]" for c in result.claims if not c.passed]
    assert not failed, "\n".join(failed)
    report = json.loads(json.dumps(result.to_json()))  # the report is plain JSON
    assert report["all_claims_passed"] is True


# The fair policy each experiment is about, and the policy it is contrasted with.
FAIR_VS_UNFAIR = {name: ("VTC", "FCFS") for name in EXPERIMENTS}
FAIR_VS_UNFAIR["vtc-dist-shift"] = ("VTC", "LCF")
FAIR_VS_UNFAIR["vtc-weighted"] = ("VTC-weighted", "VTC")


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_claims_fail_when_the_unfair_run_stands_in(quick_result, name):
    result = quick_result(name)
    fair, unfair = FAIR_VS_UNFAIR[name]
    swapped = dict(result.runs)
    swapped[fair], swapped[unfair] = result.runs[unfair], result.runs[fair]
    claims = result.experiment.claims(result.experiment, swapped, result.duration_s)
    assert not all(c.passed for c in claims), [c.detail for c in claims]


def _phase2_ratio(result: ExperimentResult, label: str) -> float:
    """max/min service of the two clients in phase 2 (both over their share), skipping
    its first fifth while the queues re-form, as the experiment's claims do."""
    third = result.duration_s / 3
    t0, t1 = third + third / 5, 2 * third
    run, cost = result.runs[label], result.experiment.cost
    s1, s2 = (run.service(c, t0, t1, cost) for c in ("client1", "client2"))
    return max(s1, s2) / min(s1, s2)


def test_lcf_is_unfair_after_a_distribution_shift_where_vtc_is_not(quick_result):
    # client1 was under its share in phase 1, so under LCF its counter fell far behind;
    # when it turns heavy in phase 2 it monopolises the worker. VTC's lift prevents that.
    result = quick_result("vtc-dist-shift")
    assert all(c.passed for c in result.claims), [c.detail for c in result.claims]
    lcf, vtc = _phase2_ratio(result, "LCF"), _phase2_ratio(result, "VTC")
    assert lcf >= 1.5, lcf
    assert vtc <= 1.1, vtc
    # It is client1, the returning client, that LCF favours.
    third = result.duration_s / 3
    run, cost = result.runs["LCF"], result.experiment.cost
    t0, t1 = third + third / 5, 2 * third
    assert run.service("client1", t0, t1, cost) > run.service("client2", t0, t1, cost)


def test_quick_runs_are_deterministic(quick_result):
    first = quick_result("vtc-weighted")
    again = run_experiment(get_experiment("vtc-weighted"), quick=True, seed=0)

    def strip(rows):  # sim_speedup is wall-clock, everything else is virtual
        return [{k: v for k, v in row.items() if k != "sim_speedup"} for row in rows]

    assert strip(again.rows) == strip(first.rows)
    assert [c.detail for c in again.claims] == [c.detail for c in first.claims]


def test_get_experiment_unknown_name_raises():
    with pytest.raises(ValueError, match="'vtc-nope'"):
        get_experiment("vtc-nope")
