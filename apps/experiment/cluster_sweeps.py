"""The sweeps: DLPM's quantum ``Q`` (Fig. 1), D2LPM's per-worker quantum ``Q_u`` (Fig. 10)
and the number of clients (Fig. 11), each against its fair and its locality-first baseline.

Defaults chosen from the sweeps (see ``dlpm-quantum`` and ``d2lpm-quantum``): DLPM's
``Q = DEFAULT_Q`` and D2LPM's ``Q_u = DEFAULT_QU``; BENCHMARKS.md records the numbers.
"""

from __future__ import annotations

import math

from sgl_fair.workloads.combos import D2LPM, DLPM1, LPM1, PREBLE, RR_LPM, VTC, VTC1, Combo

from .cluster_base import RATE_SCALE, ClusterExperiment, by_key, claim, inf_label, missing, one
from .cluster_runs import RunSpec

DEFAULT_Q = 2048.0  # DLPM's quantum (the policy's default)
DEFAULT_QU = 10_000.0  # D2LPM's per-worker quantum (the router policy's default)


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
    return ", ".join(inf_label(r["x"]) for r in rows) or "none"


def _sweep_claims(rows, label, baseline_hi, baseline_fair):
    sweep = sorted(
        (r for r in rows if r["policy"] == label and r.get("x") is not None), key=lambda r: r["x"]
    )
    hi = one(rows, policy=baseline_hi)
    fair = one(rows, policy=baseline_fair)
    if len(sweep) < 2:
        return [missing(f"{label} sweep")]
    lo_q, hi_q = sweep[0], sweep[-1]
    claims = [
        claim(
            f"{label}: a larger quantum buys throughput",
            hi_q["throughput_tok_s"] >= lo_q["throughput_tok_s"],
            f"x={inf_label(lo_q['x'])}: {lo_q['throughput_tok_s']:.0f} tok/s → "
            f"x={inf_label(hi_q['x'])}: {hi_q['throughput_tok_s']:.0f}",
        ),
        claim(
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
            claim(
                f"some quantum beats {baseline_fair}'s throughput and {baseline_hi}'s fairness",
                bool(best),
                f"{len(best)} of {len(sweep)} points (x = {_xs(best)})",
            )
        )
    return claims


DLPM_QUANTUM = ClusterExperiment(
    "dlpm-quantum",
    "DLPM Fig. 1",
    "one GPU, ToT S2: LPM vs VTC vs DLPM over a sweep of Q — throughput against Jain",
    _dlpm_quantum_specs,
    lambda rows: _sweep_claims(rows, "DLPM", "LPM", "VTC"),
    plots=("pareto", "sweep"),
    x_label="DLPM quantum Q",
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
            claim(
                "Q_u = ∞ (locality-first, Preble-like) loses to the best finite Q_u",
                inf[0]["throughput_tok_s"] < best["throughput_tok_s"],
                f"∞: {inf[0]['throughput_tok_s']:.0f} tok/s; Q_u={best['x']:g}: "
                f"{best['throughput_tok_s']:.0f}",
            )
        )
    return claims


D2LPM_QUANTUM = ClusterExperiment(
    "d2lpm-quantum",
    "DLPM Fig. 10",
    "4 GPUs, ToT S2: D2LPM throughput and Jain over Q_u from 2,000 to 40,000 and ∞",
    _d2lpm_quantum_specs,
    _d2lpm_quantum_claims,
    plots=("sweep",),
    x_label="D2LPM per-worker quantum Q_u",
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
    for n, cell in sorted(by_key(rows, ("x",)).items()):
        lpm, vtc, dlpm = (one(cell, policy=p) for p in ("LPM", "VTC", "DLPM"))
        if None in (lpm, vtc, dlpm):
            continue
        if dlpm["throughput_tok_s"] < 0.9 * lpm["throughput_tok_s"]:
            bad_lpm.append(f"{n[0]:g}")
        if dlpm["throughput_tok_s"] < vtc["throughput_tok_s"]:
            bad_vtc.append(f"{n[0]:g}")
    return [
        claim(
            "DLPM keeps ≥ 90% of LPM's throughput at every client count",
            not bad_lpm,
            f"below at n = {', '.join(bad_lpm) or 'none'}",
        ),
        claim(
            "DLPM's throughput ≥ VTC's at every client count",
            not bad_vtc,
            f"below at n = {', '.join(bad_vtc) or 'none'}",
        ),
    ]


CLIENTS = ClusterExperiment(
    "dlpm-clients",
    "DLPM Fig. 11",
    "one A10G, 5 → 50 ToT clients at constant total rate: LPM vs VTC vs DLPM",
    _clients_specs,
    _clients_claims,
    plots=("sweep",),
    x_label="number of clients",
)
