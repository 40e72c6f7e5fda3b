"""Named multi-GPU experiments: the DLPM/D2LPM paper's figures on the cluster simulator.

Each experiment is a list of ``RunSpec``s (router × local policy × dp × workload ×
scenario, sometimes a swept value) and claims about the resulting rows: the property the
paper's figure demonstrates, checked on the run itself. ``--quick`` keeps the same rates and
shapes with fewer minutes of arrivals (and fewer sweep points) so a whole experiment runs
in seconds to a few minutes on a laptop.

Defaults chosen from the sweeps (see ``dlpm-quantum`` and ``d2lpm-quantum``): DLPM's
``Q = DEFAULT_Q`` and D2LPM's ``Q_u = DEFAULT_QU``; BENCHMARKS.md records the numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sgl_fair.experiment.single import Claim
from sgl_fair.workloads.combos import (
    CACHE_AWARE,
    D2LPM,
    DLPM1,
    GRID_COMBOS,
    LPM1,
    PREBLE,
    RR_LPM,
    VTC,
    VTC1,
    Combo,
)

from .cluster_runs import RunSpec, run_many

DEFAULT_Q = 2048.0  # DLPM's quantum (the policy's default)
DEFAULT_QU = 10_000.0  # D2LPM's per-worker quantum (the router policy's default)


@dataclass(frozen=True)
class ClusterExperiment:
    name: str
    figure: str
    description: str
    build: Callable[[bool, int], list[RunSpec]]  # (quick, seed) -> runs
    claims: Callable[[list[dict[str, Any]]], list[Claim]]
    plots: tuple[str, ...] = ()
    x_label: str | None = None


@dataclass
class ClusterExperimentResult:
    experiment: ClusterExperiment
    quick: bool
    seed: int
    rows: list[dict[str, Any]]
    claims: list[Claim]
    wall_s: float

    @property
    def num_runs(self) -> int:
        return len(self.rows)

    def to_json(self) -> dict[str, Any]:
        exp = self.experiment
        return {
            "experiment": exp.name,
            "figure": exp.figure,
            "description": exp.description,
            "quick": self.quick,
            "seed": self.seed,
            "rows": self.rows,
            "claims": [c.__dict__ for c in self.claims],
            "all_claims_passed": all(c.passed for c in self.claims),
            "sim_wall_s": round(self.wall_s, 3),
        }


# ---------------------------------------------------------------- overrides (CLI flags)


@dataclass(frozen=True)
class Overrides:
    """CLI flags that narrow or change an experiment's runs (None = keep)."""

    dp: int | None = None
    router: str | None = None
    local: str | None = None
    workload: str | None = None
    scenario: str | None = None
    gpu: str | None = None
    model: str | None = None

    def any(self) -> bool:
        return any(v is not None for v in self.__dict__.values())


def _combo_key(c: Combo) -> tuple:
    return (c.label, c.router, c.local, repr(c.router_opts), repr(c.local_opts))


def apply_overrides(specs: Sequence[RunSpec], ov: Overrides) -> list[RunSpec]:
    """Set each given dimension on every run (dropping duplicates): on a sweep this selects
    a slice (``--dp 4``), on a fixed setting it changes it (``--gpu H100-80GB``). A router or
    local policy not among the experiment's pairings makes one pairing of them."""
    combos = {_combo_key(s.combo): s.combo for s in specs}
    replacement: Combo | None = None
    keep = set(combos)
    if ov.router or ov.local:
        keep = {
            k
            for k, c in combos.items()
            if (ov.router is None or c.router == ov.router)
            and (ov.local is None or c.local == ov.local)
        }
        if not keep:
            base = next(iter(combos.values()))
            router, local = ov.router or base.router, ov.local or base.local
            replacement = Combo(f"{router}+{local}", router, local)
    out: list[RunSpec] = []
    seen: set[tuple] = set()
    for s in specs:
        changes: dict[str, Any] = {}
        if replacement is not None:
            changes["combo"] = replacement
        elif _combo_key(s.combo) not in keep:
            continue
        for name in ("dp", "workload", "gpu", "model"):
            value = getattr(ov, name)
            if value is not None:
                changes[name] = value
        if ov.scenario is not None:
            changes["scenario"] = None if ov.scenario == "none" else ov.scenario
        elif ov.workload == "chat":
            changes["scenario"] = None  # chat is the Fig. 8 flood: it has no S1/S2
        s = s.replace(**changes) if changes else s
        key = (_combo_key(s.combo), s.dp, s.workload, s.scenario, s.gpu, s.model, s.x)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def run_cluster_experiment(
    exp: ClusterExperiment,
    *,
    quick: bool = False,
    seed: int = 0,
    overrides: Overrides | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> ClusterExperimentResult:
    specs = exp.build(quick, seed)
    if overrides is not None and overrides.any():
        specs = apply_overrides(specs, overrides)
    t0 = time.perf_counter()
    rows = run_many(specs, jobs=jobs, progress=progress)
    return ClusterExperimentResult(
        experiment=exp,
        quick=quick,
        seed=seed,
        rows=rows,
        claims=exp.claims(rows),
        wall_s=time.perf_counter() - t0,
    )


# ---------------------------------------------------------------- claim helpers


def _pick(rows, **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _one(rows, **match) -> dict | None:
    found = _pick(rows, **match)
    return found[0] if found else None


def _fmt(x: float | None, spec: str = "{:.3g}") -> str:
    return "-" if x is None else spec.format(x)


def _claim(text: str, ok: bool, detail: str) -> Claim:
    return Claim(text, bool(ok), detail)


def _missing(text: str) -> Claim:
    return Claim(text, False, "the runs this claim compares were filtered out")


# ---------------------------------------------------------------- experiments

EXPERIMENTS: dict[str, ClusterExperiment] = {}


def _register(exp: ClusterExperiment) -> ClusterExperiment:
    EXPERIMENTS[exp.name] = exp
    return exp


def get_cluster_experiment(name: str) -> ClusterExperiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown cluster experiment {name!r}") from None


def _inf_label(q: float) -> str:
    return "inf" if math.isinf(q) else f"{q:g}"


# Per workload and scenario, the multiple of the base program rate (programs/README) that
# overloads the cluster: the S2 misbehaver costs only 2–3.5× a well-behaved client, so tot
# and judge need more load for it to matter (programs.workloads docstring).
RATE_SCALE = {
    ("tot", "s1"): 1.0,
    ("tot", "s2"): 2.5,
    ("judge", "s1"): 1.0,
    ("judge", "s2"): 1.6,
    ("longqa", "s1"): 1.0,
    ("longqa", "s2"): 1.0,
}
GRID_WORKLOADS = ("tot", "judge", "longqa")
GRID_DPS = (1, 2, 4, 8)
QUICK_PROGRAM_SECONDS = 60.0  # quick: 60/dp s of arrivals per run (same number of programs)
FULL_SECONDS = 180.0


def _grid_specs(quick: bool, seed: int) -> list[RunSpec]:
    specs = []
    for wl in GRID_WORKLOADS:
        for sc in ("s1", "s2"):
            for dp in GRID_DPS:
                dur = QUICK_PROGRAM_SECONDS / dp if quick else FULL_SECONDS
                for combo in GRID_COMBOS:
                    if dp == 1 and combo in (PREBLE, CACHE_AWARE):
                        continue  # one GPU: routing is moot (the paper omits Preble there)
                    specs.append(
                        RunSpec(combo, dp, wl, sc, dur, rate_scale=RATE_SCALE[wl, sc], seed=seed)
                    )
    return specs


def _cells(rows):
    return _by_key(rows, ("workload", "scenario", "dp"))


def _by_key(rows, keys):
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def _ratio_claim(rows, text, metric, num_label, den_labels, *, at_least, combine=max, min_dp=2):
    """For every (workload, scenario, dp >= min_dp) cell: num / combine(den) >= at_least."""
    ratios, bad = [], []
    for key, cell in sorted(_cells(rows).items(), key=str):
        if key[2] < min_dp:
            continue
        num = _one(cell, policy=num_label)
        dens = [r[metric] for r in cell if r["policy"] in den_labels and r.get(metric)]
        if num is None or not dens or num.get(metric) is None:
            continue
        ratio = num[metric] / combine(dens)
        ratios.append(ratio)
        if ratio < at_least:
            bad.append(f"{key[0]}-{key[1]} dp={key[2]}: {ratio:.2f}")
    if not ratios:
        return _missing(text)
    detail = f"{len(ratios) - len(bad)}/{len(ratios)} cells; min {min(ratios):.2f}"
    if bad:
        detail += "; below: " + ", ".join(bad[:6]) + (" …" if len(bad) > 6 else "")
    return _claim(text, not bad, detail)


def _diff_claim(rows, text, metric, num_label, den_labels, *, slack, min_dp=2):
    """For every cell: num >= max(den) - slack."""
    diffs, bad = [], []
    for key, cell in sorted(_cells(rows).items(), key=str):
        if key[2] < min_dp:
            continue
        num = _one(cell, policy=num_label)
        dens = [r[metric] for r in cell if r["policy"] in den_labels and r.get(metric) is not None]
        if num is None or not dens or num.get(metric) is None:
            continue
        d = num[metric] - max(dens)
        diffs.append(d)
        if d < -slack:
            bad.append(f"{key[0]}-{key[1]} dp={key[2]}: {d:+.3f}")
    if not diffs:
        return _missing(text)
    detail = f"{len(diffs) - len(bad)}/{len(diffs)} cells; worst {min(diffs):+.3f}"
    if bad:
        detail += "; below: " + ", ".join(bad[:6]) + (" …" if len(bad) > 6 else "")
    return _claim(text, not bad, detail)


UNFAIR = ("RR+LPM", "Preble", "CacheAware+LPM")


def _grid_claims(rows):
    inv = [
        {**r, "inv_p99": 1.0 / r["p99_well_behaved_s"]} for r in rows if r.get("p99_well_behaved_s")
    ]
    return [
        _ratio_claim(
            rows,
            "D2LPM's throughput ≥ VTC's (fair vs fair)",
            "throughput_tok_s",
            "D2LPM",
            ("VTC",),
            at_least=1.0,
        ),
        _ratio_claim(
            rows,
            "D2LPM's throughput ≥ 0.95× the best unfair baseline",
            "throughput_tok_s",
            "D2LPM",
            UNFAIR,
            at_least=0.95,
        ),
        _diff_claim(
            rows,
            "D2LPM's Jain ≥ every locality-first baseline's − 0.02",
            "jain",
            "D2LPM",
            UNFAIR,
            slack=0.02,
        ),
        _ratio_claim(
            inv,
            "well-behaved P99 under D2LPM ≤ under Preble and RR+LPM",
            "inv_p99",
            "D2LPM",
            ("Preble", "RR+LPM"),
            at_least=1.0,
            combine=min,
        ),
    ]


_register(
    ClusterExperiment(
        "d2lpm-grid",
        "DLPM Fig. 7",
        "ToT, LLM-as-judge, long-doc QA × S1/S2 × 1–8 GPUs: D2LPM vs RR+LPM, Preble, VTC, "
        "cache-aware (Llama-3.1-8B, A100-80GB)",
        _grid_specs,
        _grid_claims,
        plots=("grid",),
    )
)


def _dlpm_quantum_specs(quick: bool, seed: int) -> list[RunSpec]:
    qs = (
        (256.0, 2048.0, 16384.0, 131072.0)
        if quick
        else (128.0, 512.0, 2048.0, 8192.0, 32768.0, 131072.0)
    )
    dur = 60.0 if quick else 240.0
    base = RunSpec(LPM1, 1, "tot", "s2", dur, rate_scale=RATE_SCALE["tot", "s2"], seed=seed)
    specs = [base, base.replace(combo=VTC1)]
    specs += [
        base.replace(combo=Combo("DLPM", "rr", "dlpm", local_opts={"quantum": q}), x=q) for q in qs
    ]
    return specs


def _xs(rows) -> str:
    return ", ".join(_inf_label(r["x"]) for r in rows) or "none"


def _sweep_claims(rows, label, baseline_hi, baseline_fair):
    sweep = sorted(
        (r for r in rows if r["policy"] == label and r.get("x") is not None), key=lambda r: r["x"]
    )
    hi = _one(rows, policy=baseline_hi)
    fair = _one(rows, policy=baseline_fair)
    if len(sweep) < 2:
        return [_missing(f"{label} sweep")]
    lo_q, hi_q = sweep[0], sweep[-1]
    claims = [
        _claim(
            f"{label}: a larger quantum buys throughput",
            hi_q["throughput_tok_s"] >= lo_q["throughput_tok_s"],
            f"x={_inf_label(lo_q['x'])}: {lo_q['throughput_tok_s']:.0f} tok/s → "
            f"x={_inf_label(hi_q['x'])}: {hi_q['throughput_tok_s']:.0f}",
        ),
        _claim(
            f"{label}: … and costs fairness (Jain does not rise with the quantum)",
            hi_q["jain"] <= lo_q["jain"] + 0.01,
            f"Jain {lo_q['jain']:.3f} → {hi_q['jain']:.3f}",
        ),
    ]
    if hi is not None and fair is not None:
        best = [
            r
            for r in sweep
            if r["throughput_tok_s"] >= fair["throughput_tok_s"] and r["jain"] >= hi["jain"]
        ]
        claims.append(
            _claim(
                f"some quantum beats {baseline_fair}'s throughput and {baseline_hi}'s fairness",
                bool(best),
                f"{len(best)} of {len(sweep)} points (x = {_xs(best)})",
            )
        )
    return claims


_register(
    ClusterExperiment(
        "dlpm-quantum",
        "DLPM Fig. 1",
        "one GPU, ToT S2: LPM vs VTC vs DLPM over a sweep of Q — throughput against Jain",
        _dlpm_quantum_specs,
        lambda rows: _sweep_claims(rows, "DLPM", "LPM", "VTC"),
        plots=("pareto", "sweep"),
        x_label="DLPM quantum Q",
    )
)


def _d2lpm_quantum_specs(quick: bool, seed: int) -> list[RunSpec]:
    qus = (
        (2000.0, 10000.0, 40000.0, math.inf)
        if quick
        else (2000.0, 5000.0, 10000.0, 20000.0, 40000.0, math.inf)
    )
    dur = 30.0 if quick else 120.0
    base = RunSpec(D2LPM, 4, "tot", "s2", dur, rate_scale=RATE_SCALE["tot", "s2"], seed=seed)
    specs = [base.replace(combo=c) for c in (VTC, PREBLE, RR_LPM)]
    specs += [
        base.replace(combo=Combo("D2LPM", "d2lpm", "dlpm", router_opts={"quantum": q}), x=q)
        for q in qus
    ]
    return specs


def _d2lpm_quantum_claims(rows):
    claims = _sweep_claims(rows, "D2LPM", "Preble", "VTC")[:2]
    sweep = [r for r in rows if r["policy"] == "D2LPM" and r.get("x") is not None]
    inf = [r for r in sweep if math.isinf(r["x"])]
    finite = [r for r in sweep if not math.isinf(r["x"])]
    if inf and finite:
        best = max(finite, key=lambda r: r["throughput_tok_s"])
        claims.append(
            _claim(
                "Q_u = ∞ (locality-first, Preble-like) loses to the best finite Q_u",
                inf[0]["throughput_tok_s"] < best["throughput_tok_s"],
                f"∞: {inf[0]['throughput_tok_s']:.0f} tok/s; Q_u={best['x']:g}: "
                f"{best['throughput_tok_s']:.0f}",
            )
        )
    return claims


_register(
    ClusterExperiment(
        "d2lpm-quantum",
        "DLPM Fig. 10",
        "4 GPUs, ToT S2: D2LPM throughput and Jain over Q_u from 2,000 to 40,000 and ∞",
        _d2lpm_quantum_specs,
        _d2lpm_quantum_claims,
        plots=("sweep",),
        x_label="D2LPM per-worker quantum Q_u",
    )
)


def _timeline_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 40.0 if quick else 180.0
    base = RunSpec(
        D2LPM,
        4,
        "tot",
        "s2",
        dur,
        gpu="A10G-24GB",
        model="Llama-3.2-3B",
        num_clients=3,
        rate_scale=1.5,
        seed=seed,
        series=True,
    )
    return [base.replace(combo=c) for c in (D2LPM, VTC, RR_LPM, PREBLE)]


def _timeline_claims(rows):
    d = _one(rows, policy="D2LPM")
    if d is None:
        return [_missing("D2LPM timeline")]
    others = [r for r in rows if r["policy"] != "D2LPM"]
    unfair = [r for r in others if r["policy"] in ("Preble", "RR+LPM")]
    claims = [
        _claim(
            "D2LPM finishes all programs no later than the others (within 5%)",
            all(d["makespan_s"] <= 1.05 * r["makespan_s"] for r in others),
            ", ".join(f"{r['policy']} {r['makespan_s']:.0f} s" for r in [d, *others]),
        )
    ]
    if unfair:
        claims.append(
            _claim(
                "well-behaved clients wait less under D2LPM than under Preble / RR+LPM (P99)",
                all(d["p99_well_behaved_s"] <= r["p99_well_behaved_s"] for r in unfair),
                ", ".join(f"{r['policy']} {r['p99_well_behaved_s']:.0f} s" for r in [d, *unfair]),
            )
        )
    return claims


_register(
    ClusterExperiment(
        "d2lpm-timeline",
        "DLPM Fig. 9",
        "4 A10G GPUs, ToT with 3 branches, client c0 with a longer prefix: response time, "
        "actual and client-perceived service over time",
        _timeline_specs,
        _timeline_claims,
        plots=("timeline",),
    )
)


def _clients_specs(quick: bool, seed: int) -> list[RunSpec]:
    counts = (5, 20, 50) if quick else (5, 10, 20, 30, 50)
    dur = 60.0 if quick else 240.0
    specs = []
    for n in counts:
        for combo in (LPM1, VTC1, DLPM1):
            specs.append(
                RunSpec(
                    combo,
                    1,
                    "tot",
                    None,
                    dur,
                    gpu="A10G-24GB",
                    model="Llama-3.2-3B",
                    num_clients=n,
                    rate_scale=2.0 * 5 / n,
                    seed=seed,
                    x=float(n),
                )
            )
    return specs


def _clients_claims(rows):
    bad_lpm, bad_vtc = [], []
    for n, cell in sorted(_by_key(rows, ("x",)).items()):
        lpm, vtc, dlpm = (_one(cell, policy=p) for p in ("LPM", "VTC", "DLPM"))
        if None in (lpm, vtc, dlpm):
            continue
        if dlpm["throughput_tok_s"] < 0.9 * lpm["throughput_tok_s"]:
            bad_lpm.append(f"{n[0]:g}")
        if dlpm["throughput_tok_s"] < vtc["throughput_tok_s"]:
            bad_vtc.append(f"{n[0]:g}")
    return [
        _claim(
            "DLPM keeps ≥ 90% of LPM's throughput at every client count",
            not bad_lpm,
            f"below at n = {', '.join(bad_lpm) or 'none'}",
        ),
        _claim(
            "DLPM's throughput ≥ VTC's at every client count",
            not bad_vtc,
            f"below at n = {', '.join(bad_vtc) or 'none'}",
        ),
    ]


_register(
    ClusterExperiment(
        "dlpm-clients",
        "DLPM Fig. 11",
        "one A10G, 5 → 50 ToT clients at constant total rate: LPM vs VTC vs DLPM",
        _clients_specs,
        _clients_claims,
        plots=("sweep",),
        x_label="number of clients",
    )
)


def _mixed_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 60.0 if quick else 240.0
    base = RunSpec(LPM1, 1, "mixed", "s1", dur, seed=seed, series=True)
    return [base.replace(combo=c) for c in (LPM1, VTC1, DLPM1)]


def _mixed_claims(rows):
    lpm, vtc, dlpm = (_one(rows, policy=p) for p in ("LPM", "VTC", "DLPM"))
    if None in (lpm, vtc, dlpm):
        return [_missing("LPM, VTC and DLPM runs")]
    return [
        _claim(
            "DLPM's well-behaved P99 ≤ LPM's",
            dlpm["p99_well_behaved_s"] <= lpm["p99_well_behaved_s"],
            f"DLPM {dlpm['p99_well_behaved_s']:.1f} s, LPM {lpm['p99_well_behaved_s']:.1f} s",
        ),
        _claim(
            "DLPM's throughput ≥ VTC's",
            dlpm["throughput_tok_s"] >= vtc["throughput_tok_s"],
            f"DLPM {dlpm['throughput_tok_s']:.0f}, VTC {vtc['throughput_tok_s']:.0f} tok/s",
        ),
    ]


_register(
    ClusterExperiment(
        "dlpm-mixed",
        "DLPM Fig. 12",
        "one GPU, clients running different programs (ToT S1 misbehaver, judge, long-doc QA, "
        "chat): LPM vs VTC vs DLPM",
        _mixed_specs,
        _mixed_claims,
        plots=("timeline",),
    )
)


def _chat_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 60.0 if quick else 300.0
    base = RunSpec(
        D2LPM, 2, "chat", None, dur, gpu="A10G-24GB", model="Llama-3.2-3B", seed=seed, series=True
    )
    return [base.replace(combo=c) for c in (RR_LPM, VTC, D2LPM)]


def _chat_claims(rows):
    lpm, vtc, d = (_one(rows, policy=p) for p in ("RR+LPM", "VTC", "D2LPM"))
    if None in (lpm, d):
        return [_missing("RR+LPM and D2LPM runs")]
    claims = [
        _claim(
            "flooding clients do not hurt well-behaved ones under D2LPM as under LPM (P99)",
            d["p99_well_behaved_s"] <= lpm["p99_well_behaved_s"],
            f"D2LPM {d['p99_well_behaved_s']:.1f} s, RR+LPM {lpm['p99_well_behaved_s']:.1f} s",
        ),
    ]
    if vtc is not None:
        claims.append(
            _claim(
                "D2LPM's throughput ≥ VTC's",
                d["throughput_tok_s"] >= vtc["throughput_tok_s"],
                f"D2LPM {d['throughput_tok_s']:.0f}, VTC {vtc['throughput_tok_s']:.0f} tok/s",
            )
        )
    return claims


_register(
    ClusterExperiment(
        "chat-flood",
        "DLPM Fig. 8",
        "2 A10G GPUs, multi-turn chat, clients c2 and c3 flooding (c2 stops halfway): "
        "RR+LPM vs VTC vs D2LPM",
        _chat_specs,
        _chat_claims,
        plots=("timeline",),
    )
)


def _single_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 30.0 if quick else 120.0
    return [RunSpec(D2LPM, 4, "tot", "s1", dur, seed=seed)]


_register(
    ClusterExperiment(
        "cluster",
        "one run",
        "one configuration from the flags (default: D2LPM+DLPM, 4 × A100-80GB, ToT S1)",
        _single_specs,
        lambda rows: [],
    )
)
