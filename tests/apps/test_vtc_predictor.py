"""The VTC experiments name the output-length predictor they run with (issue 31 item 7)."""

from __future__ import annotations

from sgl_fair.experiment.single import predictor_of, run_policy
from sgl_fair.experiment.vtc import EXPERIMENTS
from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel


def test_every_vtc_row_names_its_predictor() -> None:
    for exp in EXPERIMENTS.values():
        for spec in exp.policies:
            policy = make_policy(spec.name, **spec.options)
            if spec.name in ("vtc", "lcf"):
                assert spec.options.get("predict") == "none", (exp.name, spec.label)
                assert predictor_of(policy) == "none"
            else:
                assert predictor_of(policy) is None
    assert predictor_of(make_policy("vtc", predict="ema")) == "ema"


def test_a_run_row_carries_it() -> None:
    spec = next(s for s in EXPERIMENTS["vtc-overload"].policies if s.label == "VTC")
    reqs = [Request(f"r{i}", f"c{i % 2}", (1,) * 20, 8, i * 0.1) for i in range(10)]
    run = run_policy(
        reqs, spec, cost_model=CostModel.from_names("A10G", "Llama-2-7B"), kv_tokens=10_000,
        scheduler=SchedulerConfig(), until_s=None, cost=EXPERIMENTS["vtc-overload"].cost,
        window_s=60.0,
    )  # fmt: skip
    assert run.row["predictor"] == "none"
