"""One cluster run = one JSON row: router × local policy × dp × workload × scenario.

``RunSpec`` names everything a run depends on (it is small and picklable, so sweeps run
in worker processes); ``run_one`` builds the programs, the router and the workers,
simulates, and returns the row. Rows carry the foundation experiments' fields
(``metrics.summarize``) plus ``router``, ``local``, ``dp``, ``workload``, ``scenario``
and the well-behaved clients' latency:

* ``p50_well_behaved_s`` / ``p99_well_behaved_s`` — the mean over well-behaved clients of
  each client's P50 / P99 program end-to-end latency (first call issued → last call
  finished); for long-document QA, of its requests' TTFT (the paper's Fig. 7 metric).
  Runs drain: arrivals stop at ``duration_s`` and the cluster runs until every program
  finished (up to ``drain_factor × duration_s``); a program still unfinished then counts
  with its age at the cut-off, a lower bound, and the row says how many there were.
* ``jain`` is over client-perceived service (input + 2 × output tokens, the papers' service
  rate); ``jain_actual`` over the GPU's actual work (extend + 2 × output tokens).

Router replicas (``replicas`` set; ``cluster_replica_set.py``): R replicas behind a round-robin
load balancer, sharing the workers' service reports every ``report_period_s`` or
(``shared_state=False``) each on its own; the row then carries ``replicas``,
``report_period_s``, ``shared_state``, ``misbehaver_share`` and the replicas' staleness
(``view_lag_max`` …); with ``fault`` set, a fault injected mid-run (``cluster_fault_sim.py``:
the row carries ``fault`` and the calls' outcomes, ``calls_lost`` …). ``row_extra`` is copied
into the row (naming ``replicas`` there marks a one-router row of a replica experiment: it
gets ``misbehaver_share`` too).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any

from sgl_fair import metrics
from sgl_fair.policies import make_policy
from sgl_fair.records import RequestRecord
from sgl_fair.router import Router, make_router_policy
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cluster import ClusterConfig, ClusterResult, simulate_cluster
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.workloads.combos import Combo
from sgl_fair.workloads.program_metrics import (
    ACTUAL,
    PERCEIVED,
    program_latencies_of,
    service_series,
    well_behaved_latency_of,
)
from sgl_fair.workloads.programs import generate_programs, program_demand, workload

from .cluster_fault_sim import simulate_faults
from .cluster_replica_faults import FaultReplicaSet, fault_plan
from .cluster_replica_set import ReplicaSet


@dataclass(frozen=True)
class RunSpec:
    combo: Combo
    dp: int
    workload: str
    scenario: str | None
    duration_s: float
    gpu: str = "A100-80GB"
    model: str = "Llama-3.1-8B"
    kv_tokens: int | None = None
    num_clients: int = 4
    rate_scale: float = 1.0
    seed: int = 0
    params: Mapping[str, Any] = field(default_factory=dict)  # program params for every client
    x: float | None = None  # the swept value this run stands for (plots)
    series: bool = False  # also return per-client time series (timeline plots)
    drain_factor: float = 20.0
    net_delay_s: float = 0.0005
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    replicas: int | None = None  # None: one plain router
    report_period_s: float = 0.1
    shared_state: bool = True
    fault: str | None = None  # replicas sharing state, a fault injected mid-run (FAULTS)
    row_extra: Mapping[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> RunSpec:
        return replace(self, **changes)


def program_latencies(result: ClusterResult) -> dict[str, list[float]]:
    """Per client: each program's end-to-end latency (censored at the run's end if unfinished)."""
    return program_latencies_of(result.programs, result.submitted, result.t_end_s)


def well_behaved_latency(
    result: ClusterResult,
    records: Sequence[RequestRecord],
    well_behaved: set[str],
    *,
    use_ttft: bool,
) -> dict[str, float | None]:
    return well_behaved_latency_of(
        result.programs, records, well_behaved, t_end_s=result.t_end_s, use_ttft=use_ttft
    )


def _series(result: ClusterResult, records: Sequence[RequestRecord], t_end: float) -> dict:
    """Per-client time series for timeline plots (JSON-able)."""
    return service_series(result.events, records, t_end)


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Simulate ``spec``; return its row (JSON-able)."""
    clients = workload(
        spec.workload,
        spec.scenario,
        dp=spec.dp,
        num_clients=spec.num_clients,
        rate_scale=spec.rate_scale,
        duration_s=spec.duration_s,
    )
    if spec.params:
        clients = [replace(c, params={**c.params, **spec.params}) for c in clients]
    programs = generate_programs(clients, spec.duration_s, seed=spec.seed)
    combo = spec.combo
    router_opts = dict(combo.router_opts)
    router: Router | ReplicaSet
    if spec.replicas is None:
        router = Router(make_router_policy(combo.router, **router_opts), spec.dp)
    elif spec.fault is not None:
        router = FaultReplicaSet(
            lambda: make_router_policy(combo.router, **router_opts),
            spec.dp,
            spec.replicas,
            plan=fault_plan(spec.fault, spec.duration_s, spec.dp, spec.replicas),
            kv_event_delay_s=2 * spec.net_delay_s,
            net_delay_s=spec.net_delay_s,
        )
    else:
        router = ReplicaSet(
            lambda: make_router_policy(combo.router, **router_opts),
            spec.dp,
            spec.replicas,
            shared=spec.shared_state,
            kv_event_delay_s=2 * spec.net_delay_s,  # worker receives it, then publishes
        )
    shared = spec.replicas is not None and spec.shared_state
    config = ClusterConfig(
        dp=spec.dp,
        gpu=spec.gpu,
        model=spec.model,
        kv_tokens=spec.kv_tokens,
        scheduler=spec.scheduler,
        net_delay_s=spec.net_delay_s,
        report_period_s=spec.report_period_s if shared else None,
    )
    cost_model = CostModel.from_names(spec.gpu, spec.model)
    local_opts = dict(combo.local_opts)
    simulate = simulate_faults if isinstance(router, FaultReplicaSet) else simulate_cluster
    result = simulate(
        router=router,  # type: ignore[arg-type]
        local_policy=lambda _w: make_policy(combo.local, **local_opts),
        config=config,
        programs=programs,
        until_s=spec.duration_s * spec.drain_factor,
        cost_model=cost_model,
    )
    records = result.records()
    events = result.events
    perceived = metrics.EventArrays.from_events(events, PERCEIVED)
    summary = metrics.summarize(perceived, records, window_s=max(spec.duration_s / 10, 10.0))
    actual = perceived.repriced(ACTUAL)
    well = {c.client for c in clients if c.well_behaved}
    demand = program_demand(programs).values()
    offered_tok_s = sum(d.input_tokens + d.output_tokens for d in demand) / spec.duration_s
    served_tok_s = metrics.throughput(records, perceived, t0=0.0, t1=spec.duration_s)["tok_s"]
    interval = metrics.active_interval(records)
    jain_actual = None
    if interval is not None and interval[1] > interval[0]:
        served = metrics.per_client_service(actual, t0=interval[0], t1=interval[1])
        jain_actual = metrics.jain_index(served.get(c.client, 0.0) for c in clients)
    row: dict[str, Any] = {
        "policy": combo.label,
        "router": combo.router,
        "local": combo.local,
        "router_opts": dict(combo.router_opts),
        "local_opts": dict(combo.local_opts),
        "dp": spec.dp,
        "workload": spec.workload,
        "scenario": spec.scenario,
        "x": spec.x,
        **well_behaved_latency(result, records, well, use_ttft=spec.workload == "longqa"),
        **summary,
        "offered_tok_s": offered_tok_s,
        "served_tok_s": served_tok_s,
        "jain_actual": jain_actual,
        "misbehaving": sorted(c.client for c in clients if not c.well_behaved),
        "num_programs": len(programs),
        "num_calls": len(records),
        "unfinished_calls": result.unfinished,
        "makespan_s": result.t_end_s,
        "dispatch_counts": result.dispatch_counts(),
        "gpu_busy_frac": [
            round(b / result.t_end_s, 3) if result.t_end_s else 0.0 for b in result.busy_s
        ],
        "num_retractions": sum(s.num_retractions for s in result.stats),
        "gpu": spec.gpu,
        "model": spec.model,
        "kv_tokens": result.workers[0].scheduler.kv.capacity_tokens,
        "duration_s": spec.duration_s,
        "seed": spec.seed,
        "sim_wall_s": round(result.wall_s, 3),
        **spec.row_extra,
    }
    if isinstance(router, ReplicaSet) or "replicas" in spec.row_extra:
        misbehaving = set(row["misbehaving"])
        rates = {c: v["service_rate"] for c, v in summary["clients"].items()}
        total = sum(rates.values())
        row["misbehaver_share"] = (
            sum(v for c, v in rates.items() if c in misbehaving) / total if total else None
        )
    if isinstance(router, ReplicaSet):
        row.update(
            replicas=spec.replicas,
            report_period_s=spec.report_period_s if spec.shared_state else None,
            shared_state=spec.shared_state,
            **router.stats(),
        )
    if spec.series:
        row["series"] = _series(result, records, result.t_end_s)
    return row


def run_many(
    specs: Sequence[RunSpec],
    *,
    jobs: int | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every spec (in ``jobs`` processes; default: one per CPU), rows in spec order."""
    jobs = jobs or os.cpu_count() or 1
    jobs = max(1, min(jobs, len(specs)))
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    if jobs == 1:
        for i, spec in enumerate(specs):
            rows[i] = run_one(spec)
            if progress:
                progress(i + 1, len(specs), rows[i])
        return rows  # type: ignore[return-value]
    # Longest first (bigger dp, longer runs) so the pool's tail is short.
    order = sorted(range(len(specs)), key=lambda i: -specs[i].dp * specs[i].duration_s)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, specs[i]): i for i in order}
        for n, fut in enumerate(as_completed(futures), 1):
            rows[futures[fut]] = fut.result()
            if progress:
                progress(n, len(specs), rows[futures[fut]])
    return rows  # type: ignore[return-value]
