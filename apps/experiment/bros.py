"""BROS experiments (issue 12; BROS paper Fig. 10–11, 13, 14 shapes) on one simulated worker.

* ``bros-hybrid``: RT chat (Poisson, ShareGPT-like log-normal lengths) at 5 rates beside a
  closed-loop BE job: batches of uniform(512, 1024)-in / uniform(32, 128)-out requests, the
  next batch submitted when the previous one completes, at each size of ``BE_BATCHES``.
  Policies ``fcfs`` (vLLM-like), ``rr`` (alternate RT/BE each iteration) and ``bros``, all
  on the paged block allocator.
* ``bros-bicache``: ``bros`` with the bidirectional allocator vs the paged one in the paper's
  Fig. 13 setting (OPT-30B TP 4 on 4×A100-40GB), against the paper's "No Bi-cache" (a request
  that finds no block is recomputed) and our two stronger paged arms (``bros_bicache.py``);
  ``bros-bicache-llama70b``: the same arms in the earlier Llama-3-70B setting.
* ``bros-overhead``: ``bros``'s ``select_batch`` time per iteration as a share of the
  iteration time, and on 512 RT + 512 BE candidates.

The workload, the driver and the per-run metrics are in ``bros_workload.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sgl_fair.experiment import bros_bicache
from sgl_fair.experiment.bros_workload import (
    B0_8,
    BE_BATCH,
    BE_BATCHES,
    BLOCK_SIZE,
    GPU,
    MODEL,
    PAPER_VLLM_TTFT_ATTAIN,
    RATES,
    TP,
    Setting,
    run_one,
)
from sgl_fair.experiment.registry import ExperimentEntry, ExperimentOutput, register
from sgl_fair.policies import make_policy
from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel


@dataclass(frozen=True)
class BrosExperiment:
    name: str
    figure: str
    description: str
    run: Callable[[bool, int], dict[str, Any]]  # (quick, seed) -> results JSON


# ---------------------------------------------------------------- experiments


def _claim(text: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"text": text, "passed": bool(passed), "detail": detail}


def _mean(rows: Sequence[dict], key: str, **match: Any) -> float:
    vals = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return sum(vals) / max(len(vals), 1)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def hybrid_claims(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """The issue's targets, means over the rates, at each BE batch size (never tuned for)."""
    claims = []
    for be_batch in sorted({r.get("be_batch", BE_BATCH) for r in rows}):
        at = [r for r in rows if r.get("be_batch", BE_BATCH) == be_batch]
        claims += _hybrid_claims_at(at, f" (BE batch {be_batch})")
    return claims


def _hybrid_claims_at(rows: Sequence[dict], suffix: str) -> list[dict[str, Any]]:
    keys = ("rt_norm_latency_s", "rt_ttft_attain", "be_throughput_tok_s")
    m = {p: {k: _mean(rows, k, policy=p) for k in keys} for p in ("fcfs", "rr", "bros")}
    lat_f = _ratio(m["bros"]["rt_norm_latency_s"], m["fcfs"]["rt_norm_latency_s"])
    lat_r = _ratio(m["bros"]["rt_norm_latency_s"], m["rr"]["rt_norm_latency_s"])
    ttft = _ratio(m["bros"]["rt_ttft_attain"], m["fcfs"]["rt_ttft_attain"])
    be = _ratio(m["bros"]["be_throughput_tok_s"], m["fcfs"]["be_throughput_tok_s"])
    return [
        _claim(
            f"bros RT normalized latency <= 0.5x fcfs{suffix}", lat_f <= 0.5, f"ratio={lat_f:.3f}"
        ),
        _claim(
            f"bros RT normalized latency <= 0.7x rr{suffix}", lat_r <= 0.7, f"ratio={lat_r:.3f}"
        ),
        _claim(f"bros RT TTFT attainment >= 3x fcfs{suffix}", ttft >= 3.0, f"ratio={ttft:.3f}"),
        _claim(f"bros BE tok/s >= 0.85x fcfs{suffix}", be >= 0.85, f"ratio={be:.3f}"),
    ]


def hybrid_regimes(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """How hard each BE batch size loads the GPU, read off FCFS (the paper's vLLM: 1.28 %)."""
    out = []
    for be_batch in sorted({r.get("be_batch", BE_BATCH) for r in rows}):
        at = [r for r in rows if r.get("be_batch", BE_BATCH) == be_batch]
        out.append(
            {
                "be_batch": be_batch,
                "fcfs_rt_ttft_attain": round(_mean(at, "rt_ttft_attain", policy="fcfs"), 4),
                "fcfs_rates_with_no_ttft_met": sum(
                    1 for r in at if r["policy"] == "fcfs" and r["rt_ttft_attain"] == 0
                ),
                "paper_vllm_rt_ttft_attain": PAPER_VLLM_TTFT_ATTAIN,
            }
        )
    return out


def run_hybrid(quick: bool, seed: int) -> dict[str, Any]:
    """Every BE batch size at every rate; ``--quick`` shortens the runs, and runs the heavy
    sizes (a batch cycle takes FCFS ~30-60 s) at 60 s and three rates."""
    duration = 20.0 if quick else 120.0
    rows = []
    for be_batch in BE_BATCHES:
        light = be_batch == BE_BATCH
        dur = duration if light or not quick else 60.0
        rates = RATES if light or not quick else RATES[::2]
        for rate in rates:
            rows += [run_one(p, rate, dur, seed, be_batch=be_batch) for p in ("fcfs", "rr", "bros")]
            if light:  # the B0 ablation at the light load only (it collapses there already)
                rows.append(run_one("bros", rate, dur, seed, options=B0_8))
    out = _result(EXPERIMENTS["bros-hybrid"], quick, seed, duration, rows, hybrid_claims(rows))
    out["be_regimes"] = hybrid_regimes(rows)
    return out


def run_bicache(quick: bool, seed: int) -> dict[str, Any]:
    """The paper's setting and baseline (``bros_bicache.py``)."""
    duration, rows, summary = bros_bicache.run_paper(quick, seed)
    out = _result(EXPERIMENTS["bros-bicache"], quick, seed, duration, rows, summary["claims"])
    out["worker"] = _worker(bros_bicache.PAPER)
    out["gains"] = summary["gains"]
    return out


def run_bicache_llama70b(quick: bool, seed: int) -> dict[str, Any]:
    duration, rows, summary = bros_bicache.run_llama70b(quick, seed)
    out = _result(
        EXPERIMENTS["bros-bicache-llama70b"], quick, seed, duration, rows, summary["claims"]
    )
    out["worker"]["kv_tokens"] = bros_bicache.LLAMA70B_KV_TOKENS
    out["gains"] = summary["gains"]
    return out


def _worker(setting: Setting) -> dict[str, Any]:
    return {
        "gpu": setting.gpu,
        "model": setting.model,
        "tp": setting.tp,
        "block_size": BLOCK_SIZE,
        "kv_tokens": setting.pool_tokens(),
    }


class _View:
    def __init__(self, max_running: int) -> None:
        self.now = 100.0
        self.running: list[Request] = []
        self.config = SchedulerConfig(max_running_requests=max_running)

    def prefix_len(self, req: Request) -> int:
        return 0


def selection_time_ms(num_rt: int = 512, num_be: int = 512, repeats: int = 20) -> float:
    """Median ``select_batch`` time on ``num_rt`` + ``num_be`` candidates (half decoding)."""
    rng = random.Random(0)
    cost = CostModel.from_names(GPU, MODEL, TP).step_time
    cands = []
    for i in range(num_rt + num_be):
        cls = ServiceClass.RT if i < num_rt else ServiceClass.BE
        r = Request(
            f"r{i}",
            "c",
            tuple(range(1, rng.randint(16, 1024))),
            64,
            100.0 - rng.uniform(0, 0.3),
            service_class=cls,
        )
        if i % 2:
            r.phase, r.output_ids = Phase.RUNNING, [1] * rng.randint(1, 32)
        cands.append(r)
    view, times = _View(1024), []
    policy = make_policy("bros")
    for _ in range(repeats):
        t0 = time.perf_counter()
        policy.select_batch(cands, view, cost)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


# Timing runs per cell at full length: the simulation repeats exactly, only wall time varies.
# The least is the scheduler's own cost; the rest is other work on the machine (a shared VM
# runs a fixed loop up to 2x slower in some spells). Rows give both ends.
OVERHEAD_REPEATS = 3


def run_overhead(quick: bool, seed: int) -> dict[str, Any]:
    """At every BE batch size: the heavy ones keep hundreds of BE requests waiting, which
    BROS's BE phase scans every iteration (the claim holds per size)."""
    duration = 10.0 if quick else 60.0
    repeats = 1 if quick else OVERHEAD_REPEATS
    cells = [
        (be_batch, rate, duration if be_batch == BE_BATCH or not quick else 30.0)
        for be_batch in BE_BATCHES
        for rate in ((RATES[1], RATES[-1]) if quick else RATES)
    ]
    # Whole sweeps one after another, so a cell's timing runs are minutes apart, not seconds
    # (a slow spell of the machine then spoils one of them, not all).
    runs = [[run_one("bros", r, d, seed, be_batch=b) for b, r, d in cells] for _ in range(repeats)]
    rows = []
    for i, (be_batch, rate, _) in enumerate(cells):
        ms = [sweep[i]["sched_ms_per_iter"] for sweep in runs]
        share = [sweep[i]["sched_share_of_iter"] for sweep in runs]
        rows.append(
            {
                "policy": "bros",
                "rate": rate,
                "be_batch": be_batch,
                "repeats": repeats,
                "sched_ms_per_iter": min(ms),
                "sched_ms_per_iter_max": max(ms),
                "sched_share_of_iter": min(share),
                "sched_share_of_iter_max": max(share),
            }
        )
    ms = selection_time_ms()
    rows.append({"policy": "bros", "candidates": "512 RT + 512 BE", "select_ms": round(ms, 3)})
    claims = [_claim("batch selection for 512 RT + 512 BE <= 1 ms", ms <= 1.0, f"{ms:.3f} ms")]
    for be_batch in BE_BATCHES:
        cells = [r for r in rows if r.get("be_batch") == be_batch]
        share = max(r["sched_share_of_iter"] for r in cells)
        worst = max(r["sched_share_of_iter_max"] for r in cells)
        claims.append(
            _claim(
                f"scheduling time < 2% of iteration time (BE batch {be_batch})",
                share < 0.02,
                f"max share={share:.4f}"
                + (
                    f" (per rate the least of {repeats} timing runs; any run's most: {worst:.4f})"
                    if repeats > 1
                    else ""
                ),
            )
        )
    return _result(EXPERIMENTS["bros-overhead"], quick, seed, duration, rows, claims)


def _result(exp: BrosExperiment, quick, seed, duration, rows, claims) -> dict[str, Any]:
    return {
        "experiment": exp.name,
        "figure": exp.figure,
        "description": exp.description,
        "quick": quick,
        "seed": seed,
        "duration_s": duration,
        "worker": {"gpu": GPU, "model": MODEL, "tp": TP, "block_size": BLOCK_SIZE},
        "rows": rows,
        "claims": claims,
        "all_claims_passed": all(c["passed"] for c in claims) if claims else None,
    }


EXPERIMENTS: dict[str, BrosExperiment] = {
    e.name: e
    for e in (
        BrosExperiment(
            "bros-hybrid",
            "BROS Fig. 10-11",
            "RT chat at 5 Poisson rates beside closed-loop BE batches of 32, 256 and 512 "
            "requests: fcfs vs rr vs bros (and bros-b0-8: SPEC's literal B0 = 8, an ablation "
            "of the adaptive B, at 32).",
            run_hybrid,
        ),
        BrosExperiment(
            "bros-bicache",
            "BROS Fig. 13",
            "bros with the bidirectional KV cache vs without (the paper's No Bi-cache: a request "
            "failing to get a block is recomputed; and our RT-retracts-BE and RT-waits arms), "
            "OPT-30B TP 4 on 4xA100-40GB, RT 6-14 req/s beside BE batches of 32, 256, 512.",
            run_bicache,
        ),
        BrosExperiment(
            "bros-bicache-llama70b",
            "BROS Fig. 13 (our earlier setting)",
            "bros-bicache's four arms on Llama-3-70B TP 8 with a 12,000-token pool, BE batch 32.",
            run_bicache_llama70b,
        ),
        BrosExperiment(
            "bros-overhead",
            "BROS Fig. 14",
            "bros batch-selection time per iteration, as a share of iteration time.",
            run_overhead,
        ),
    )
}


# ---------------------------------------------------------------- the experiment registry


def _show(result: ExperimentOutput, paths: dict) -> None:
    exp = result.experiment
    print(f"{exp.name} ({exp.figure}) — {exp.description}")
    for row in result.rows:
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    for c in result.claims:
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['text']} — {c['detail']}")
    print(f"results: {paths['results']}")


def _entry(exp: BrosExperiment) -> ExperimentEntry:
    return ExperimentEntry(
        exp.name,
        exp.figure,
        exp.description,
        run=lambda o: ExperimentOutput.from_json(exp, exp.run(o.quick, o.seed)),
        quick={"runs": "shorter runs, fewer rates for the heavy BE batches (see each runner)"},
        show=_show,
    )


for _exp in EXPERIMENTS.values():
    register(_entry(_exp), family=__name__)
