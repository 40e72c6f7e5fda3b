"""The runs watched over time (per-client series, timeline plots): D2LPM's timeline on four
A10Gs (Fig. 9), clients running different programs (Fig. 12) and the chat flood (Fig. 8)."""

from __future__ import annotations

from sgl_fair.workloads.combos import D2LPM, DLPM1, LPM1, PREBLE, RR_LPM, VTC, VTC1

from .cluster_base import ClusterExperiment, claim, missing, one
from .cluster_runs import RunSpec


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
    d = one(rows, policy="D2LPM")
    if d is None:
        return [missing("D2LPM timeline")]
    others = [r for r in rows if r["policy"] != "D2LPM"]
    unfair = [r for r in others if r["policy"] in ("Preble", "RR+LPM")]
    claims = [
        claim(
            "D2LPM finishes all programs no later than the others (within 5%)",
            all(d["makespan_s"] <= 1.05 * r["makespan_s"] for r in others),
            ", ".join(f"{r['policy']} {r['makespan_s']:.0f} s" for r in [d, *others]),
        )
    ]
    if unfair:
        claims.append(
            claim(
                "well-behaved clients wait less under D2LPM than under Preble / RR+LPM (P99)",
                all(d["p99_well_behaved_s"] <= r["p99_well_behaved_s"] for r in unfair),
                ", ".join(f"{r['policy']} {r['p99_well_behaved_s']:.0f} s" for r in [d, *unfair]),
            )
        )
    return claims


TIMELINE = ClusterExperiment(
    "d2lpm-timeline",
    "DLPM Fig. 9",
    "4 A10G GPUs, ToT with 3 branches, client c0 with a longer prefix: response time, "
    "actual and client-perceived service over time",
    _timeline_specs,
    _timeline_claims,
    plots=("timeline",),
)


def _mixed_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 60.0 if quick else 240.0
    base = RunSpec(LPM1, 1, "mixed", "s1", dur, seed=seed, series=True)
    return [base.replace(combo=c) for c in (LPM1, VTC1, DLPM1)]


def _mixed_claims(rows):
    lpm, vtc, dlpm = (one(rows, policy=p) for p in ("LPM", "VTC", "DLPM"))
    if None in (lpm, vtc, dlpm):
        return [missing("LPM, VTC and DLPM runs")]
    return [
        claim(
            "DLPM's well-behaved P99 ≤ LPM's",
            dlpm["p99_well_behaved_s"] <= lpm["p99_well_behaved_s"],
            f"DLPM {dlpm['p99_well_behaved_s']:.1f} s, LPM {lpm['p99_well_behaved_s']:.1f} s",
        ),
        claim(
            "DLPM's throughput ≥ VTC's",
            dlpm["throughput_tok_s"] >= vtc["throughput_tok_s"],
            f"DLPM {dlpm['throughput_tok_s']:.0f}, VTC {vtc['throughput_tok_s']:.0f} tok/s",
        ),
    ]


MIXED = ClusterExperiment(
    "dlpm-mixed",
    "DLPM Fig. 12",
    "one GPU, clients running different programs (ToT S1 misbehaver, judge, long-doc QA, "
    "chat): LPM vs VTC vs DLPM",
    _mixed_specs,
    _mixed_claims,
    plots=("timeline",),
)


def _chat_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 60.0 if quick else 300.0
    base = RunSpec(
        D2LPM, 2, "chat", None, dur, gpu="A10G-24GB", model="Llama-3.2-3B", seed=seed, series=True
    )
    return [base.replace(combo=c) for c in (RR_LPM, VTC, D2LPM)]


def _chat_claims(rows):
    lpm, vtc, d = (one(rows, policy=p) for p in ("RR+LPM", "VTC", "D2LPM"))
    if None in (lpm, d):
        return [missing("RR+LPM and D2LPM runs")]
    claims = [
        claim(
            "flooding clients do not hurt well-behaved ones under D2LPM as under LPM (P99)",
            d["p99_well_behaved_s"] <= lpm["p99_well_behaved_s"],
            f"D2LPM {d['p99_well_behaved_s']:.1f} s, RR+LPM {lpm['p99_well_behaved_s']:.1f} s",
        ),
    ]
    if vtc is not None:
        claims.append(
            claim(
                "D2LPM's throughput ≥ VTC's",
                d["throughput_tok_s"] >= vtc["throughput_tok_s"],
                f"D2LPM {d['throughput_tok_s']:.0f}, VTC {vtc['throughput_tok_s']:.0f} tok/s",
            )
        )
    return claims


CHAT_FLOOD = ClusterExperiment(
    "chat-flood",
    "DLPM Fig. 8",
    "2 A10G GPUs, multi-turn chat, clients c2 and c3 flooding (c2 stops halfway): "
    "RR+LPM vs VTC vs D2LPM",
    _chat_specs,
    _chat_claims,
    plots=("timeline",),
)
