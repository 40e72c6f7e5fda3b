"""One-worker experiments: the papers' figures, run on the simulator in virtual time.

An ``Experiment`` is a workload (client specs), a worker (GPU, model, KV pool),
the policies it compares, and *claims*: checks of the property the paper's figure
demonstrates, evaluated on the run itself (``Claim.passed``) and printed in the
report. The VTC experiments follow the paper's §5.2 setup: Llama-2-7B on one
A10G with a 10,000-token KV pool, service = input + 2 × output tokens, 60 s windows.

``--quick`` shrinks the duration (same rates, fewer minutes) so that every
experiment finishes in a few seconds; the claims must still hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair import metrics
from sgl_fair.cost import CostFunction, WeightedTokens
from sgl_fair.experiment.registry import Claim, ExperimentOutput
from sgl_fair.policies import PolicyCaps, make_policy
from sgl_fair.records import RequestRecord, ServiceEvent
from sgl_fair.request import Request
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import SimResult, make_sim_worker, simulate
from sgl_fair.workloads.traces import ClientSpec, client_weights, generate


@dataclass(frozen=True)
class PolicySpec:
    """A policy under test: ``label`` in tables, registry ``name``, options."""

    label: str
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    weighted: bool = False  # pass the workload's client weights as ``weights``


@dataclass
class PolicyRun:
    spec: PolicySpec
    result: SimResult
    arrays: metrics.EventArrays  # the run's events, priced once with the experiment's cost
    records: list[RequestRecord]
    row: dict[str, Any]

    @property
    def events(self) -> list[ServiceEvent]:
        return self.result.log.events

    def service(self, client: str, t0: float, t1: float, cost: CostFunction) -> float:
        arrays = self.arrays if cost == self.arrays.cost else self.events
        return metrics.per_client_service(arrays, cost, t0=t0, t1=t1).get(client, 0.0)


@dataclass(frozen=True)
class Experiment:
    name: str
    figure: str
    description: str
    clients: Callable[[float], list[ClientSpec]]  # duration_s -> client specs
    duration_s: float
    quick_duration_s: float
    policies: tuple[PolicySpec, ...]
    claims: Callable[[Experiment, dict[str, PolicyRun], float], list[Claim]]
    gpu: str = "A10G-24GB"
    model: str = "Llama-2-7B"
    kv_tokens: int | None = 10_000
    window_s: float = 60.0
    cost: CostFunction = field(default_factory=WeightedTokens)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


# What ``run_experiment`` returns: the one result shape, its ``runs`` the ``PolicyRun``s by
# label (the report's plots read them) and its ``experiment`` the ``Experiment``.
ExperimentResult = ExperimentOutput


# ---------------------------------------------------------------- running


def run_policy(
    requests: Sequence[Request],
    spec: PolicySpec,
    *,
    cost_model: CostModel,
    kv_tokens: int | None,
    scheduler: SchedulerConfig,
    until_s: float | None,
    cost: CostFunction,
    window_s: float,
    weights: Mapping[str, float] | None = None,
) -> PolicyRun:
    options = dict(spec.options)
    if spec.weighted and weights:
        options["weights"] = dict(weights)
    policy = make_policy(spec.name, **options)
    sched, engine = make_sim_worker(
        policy=policy, cost_model=cost_model, kv_tokens=kv_tokens, config=scheduler
    )
    result = simulate(requests, scheduler=sched, engine=engine, until_s=until_s)
    records = result.records()
    arrays = metrics.EventArrays.from_events(result.log.events, cost)
    row = {"policy": spec.label, **metrics.summarize(arrays, records, cost, window_s=window_s)}
    row["sim_speedup"] = round(result.speedup, 1)
    row["num_retractions"] = result.stats.num_retractions
    predictor = predictor_of(policy)
    if predictor is not None:
        row["predictor"] = predictor
    return PolicyRun(spec, result, arrays, records, row)


def predictor_of(policy: Any) -> str | None:
    """The output-length predictor a policy charges with (VTC's ``predict``: ``none``,
    ``predict`` — the paper's mean of the last 5 —, ``ema`` — the artifact's moving
    average — or ``oracle``), named in the rows; None for a policy without one."""
    return PolicyCaps.of(policy).predictor


def fresh_copy(requests: Sequence[Request]) -> list[Request]:
    """Unscheduled copies: each policy must see the same, untouched workload."""
    return [r.unscheduled_copy() for r in requests]


def run_experiment(exp: Experiment, *, quick: bool = False, seed: int = 0) -> ExperimentOutput:
    duration = exp.quick_duration_s if quick else exp.duration_s
    specs = exp.clients(duration)
    requests = generate(specs, duration_s=duration, seed=seed)
    cost_model = CostModel.from_names(exp.gpu, exp.model)
    weights = client_weights(specs)
    wall0 = time.perf_counter()
    runs = {
        spec.label: run_policy(
            fresh_copy(requests),
            spec,
            cost_model=cost_model,
            kv_tokens=exp.kv_tokens,
            scheduler=exp.scheduler,
            until_s=duration,
            cost=exp.cost,
            window_s=exp.window_s,
            weights=weights,
        )
        for spec in exp.policies
    }
    claims = exp.claims(exp, runs, duration)
    first = next(iter(runs.values()), None)
    kv_tokens = first.result.kv_capacity_tokens if first else None
    return ExperimentOutput(
        exp,
        quick,
        seed,
        rows=[run.row for run in runs.values()],
        claims=claims,
        extras={
            "window_s": exp.window_s,
            "worker": {**cost_model.describe(), "kv_tokens": kv_tokens},
        },
        duration_s=duration,
        wall_s=time.perf_counter() - wall0,
        runs=runs,
    )
