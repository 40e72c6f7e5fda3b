"""The experiment registry and the one result shape (``sgl_fair.experiment.registry``).

An experiment registered from outside is listed and run by the CLI like the papers' ones
(nothing in the CLI knows the families); the result's JSON keeps every family's keys in one
order: the common head, the family's extras, rows, claims, the verdict, the wall time.
"""

from __future__ import annotations

import json

import pytest

from sgl_fair.experiment.cli import main
from sgl_fair.experiment.registry import (
    EXPERIMENTS,
    Claim,
    ExperimentEntry,
    ExperimentOutput,
    RunOptions,
    register,
)
from sgl_fair.experiment.vtc import EXPERIMENTS as VTC


def _toy_run(options: RunOptions) -> ExperimentOutput:
    entry = EXPERIMENTS.get("toy-test")
    rows = [{"policy": "p", "seed": options.seed, "dp": options.flags.get("dp")}]
    claim = Claim("the seed is passed through", rows[0]["seed"] == options.seed, "")
    return ExperimentOutput(
        entry, options.quick, options.seed, rows, [claim], extras={"worker": {"gpu": "none"}}
    )


@pytest.fixture
def toy():
    entry = register(
        ExperimentEntry("toy-test", "Fig. 0", "a toy", _toy_run, flags=frozenset({"dp"})),
        family="tests",
    )
    yield entry
    del EXPERIMENTS._entries["toy-test"], EXPERIMENTS._family["toy-test"]


def test_every_vtc_experiment_is_registered_in_order():
    names = EXPERIMENTS.names()
    assert names[: len(VTC)] == list(VTC)
    for name in VTC:
        entry = EXPERIMENTS.get(name)
        assert entry.figure == VTC[name].figure
        assert entry.quick == {"duration_s": VTC[name].quick_duration_s}


def test_unknown_and_duplicate_names_are_one_line_errors(toy):
    with pytest.raises(ValueError, match=r"unknown experiment 'nope' \(known: vtc-overload, "):
        EXPERIMENTS.get("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register(toy, family="tests")


def test_a_registered_experiment_runs_through_the_cli(toy, tmp_path, capsys):
    assert main(["list"]) == 0
    assert "toy-test" in capsys.readouterr().out
    out = tmp_path / "toy"
    assert main(["run", "toy-test", "--seed", "7", "--dp", "3", "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"] == [{"policy": "p", "seed": 7, "dp": 3}]
    assert json.loads((out / "results.json").read_text()) == data
    assert main(["run", "toy-test", "--router", "rr"]) == 2  # a flag it does not take
    assert "--router: only for cluster experiments, not toy-test" in capsys.readouterr().err


def test_result_json_keys_in_one_order():
    exp = EXPERIMENTS.get("vtc-weighted")
    out = ExperimentOutput(
        exp, True, 3, [{"a": 1}], [Claim("c", False, "d")], extras={"worker": {}, "dp": 2},
        duration_s=60.0, wall_s=1.23456,
    )  # fmt: skip
    data = out.to_json()
    assert list(data) == [
        "experiment", "figure", "description", "quick", "seed", "duration_s", "worker", "dp",
        "rows", "claims", "all_claims_passed", "sim_wall_s",
    ]  # fmt: skip
    assert data["claims"] == [{"text": "c", "passed": False, "detail": "d"}]
    assert data["all_claims_passed"] is False and data["sim_wall_s"] == 1.235
    bare = ExperimentOutput(exp, False, 0, [], []).to_json()
    assert "duration_s" not in bare and "sim_wall_s" not in bare
    assert bare["all_claims_passed"] is None  # no claims: neither passed nor failed
