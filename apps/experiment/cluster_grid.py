"""``d2lpm-grid`` (DLPM Fig. 7): every program workload × S1/S2 × 1–8 GPUs × the router and
local policy pairings, and the claims that hold in every cell of the grid.

D2LPM runs at two settings: ``D2LPM`` at the defaults (sliding deficits, ``Q_u`` = 300,000;
the live server's) and, from 2 GPUs, ``D2LPM-paper`` at the paper's (rounds, ``Q_u`` =
10,000; its rows' ``router_opts`` say so). The claims are about ``D2LPM``."""

from __future__ import annotations

from sgl_fair.workloads.combos import CACHE_AWARE, D2LPM, D2LPM_PAPER, GRID_COMBOS, PREBLE

from .cluster_base import RATE_SCALE, ClusterExperiment, by_key, claim, missing, one
from .cluster_runs import RunSpec

GRID_WORKLOADS = ("tot", "judge", "longqa")
GRID_DPS = (1, 2, 4, 8)
QUICK_PROGRAM_SECONDS = 60.0  # quick: 60/dp s of arrivals per run (same number of programs)
FULL_SECONDS = 180.0


# The defaults' rows, then the paper setting's beside them.
COMBOS = tuple(c for d in GRID_COMBOS for c in ((d, D2LPM_PAPER) if d == D2LPM else (d,)))


def _grid_specs(quick: bool, seed: int) -> list[RunSpec]:
    specs = []
    for wl in GRID_WORKLOADS:
        for sc in ("s1", "s2"):
            for dp in GRID_DPS:
                dur = QUICK_PROGRAM_SECONDS / dp if quick else FULL_SECONDS
                for combo in COMBOS:
                    if dp == 1 and combo in (PREBLE, CACHE_AWARE, D2LPM_PAPER):
                        continue  # one GPU: routing is moot (the paper omits Preble there)
                    specs.append(
                        RunSpec(combo, dp, wl, sc, dur, rate_scale=RATE_SCALE[wl, sc], seed=seed)
                    )
    return specs


def _cells(rows):
    return by_key(rows, ("workload", "scenario", "dp"))


def _detail(n: int, what: str, extreme: str, bad: list[str]) -> str:
    """ "k/n cells; min 0.97; below: …" (the first six failures)."""
    out = f"{n - len(bad)}/{n} {what}; {extreme}"
    if bad:
        out += "; below: " + ", ".join(bad[:6]) + (" …" if len(bad) > 6 else "")
    return out


def _ratio_claim(rows, text, metric, num_label, den_labels, *, at_least, combine=max, min_dp=2):
    """For every (workload, scenario, dp >= min_dp) cell: num / combine(den) >= at_least."""
    ratios, bad = [], []
    for key, cell in sorted(_cells(rows).items(), key=str):
        if key[2] < min_dp:
            continue
        num = one(cell, policy=num_label)
        dens = [r[metric] for r in cell if r["policy"] in den_labels and r.get(metric)]
        if num is None or not dens or num.get(metric) is None:
            continue
        ratio = num[metric] / combine(dens)
        ratios.append(ratio)
        if ratio < at_least:
            bad.append(f"{key[0]}-{key[1]} dp={key[2]}: {ratio:.2f}")
    if not ratios:
        return missing(text)
    return claim(text, not bad, _detail(len(ratios), "cells", f"min {min(ratios):.2f}", bad))


def _diff_claim(rows, text, metric, num_label, den_labels, *, slack, min_dp=2):
    """For every cell: num >= max(den) - slack."""
    diffs, bad = [], []
    for key, cell in sorted(_cells(rows).items(), key=str):
        if key[2] < min_dp:
            continue
        num = one(cell, policy=num_label)
        dens = [r[metric] for r in cell if r["policy"] in den_labels and r.get(metric) is not None]
        if num is None or not dens or num.get(metric) is None:
            continue
        d = num[metric] - max(dens)
        diffs.append(d)
        if d < -slack:
            bad.append(f"{key[0]}-{key[1]} dp={key[2]}: {d:+.3f}")
    if not diffs:
        return missing(text)
    return claim(text, not bad, _detail(len(diffs), "cells", f"worst {min(diffs):+.3f}", bad))


UNFAIR = ("RR+LPM", "Preble", "CacheAware+LPM")
OVERLOADED = 0.9  # a cell is overloaded when even its best system serves < 90 % of the offer
# Throughput in the claims is ``served_tok_s``: tokens served while programs arrive (the
# cell's overloaded window). ``throughput_tok_s`` runs to the drained end, whose tail is an
# underloaded cluster finishing the backlog; it is in the table, not in the claims.
SERVED = "served_tok_s"


def _overload_claim(rows):
    """Every cell is overloaded for its best system (issue 15: comparisons of unsaturated
    cells say nothing)."""
    bad, n = [], 0
    for key, cell in sorted(_cells(rows).items(), key=str):
        served = [r for r in cell if r.get(SERVED) is not None and r.get("offered_tok_s")]
        if not served:
            continue
        n += 1
        best = max(served, key=lambda r: r[SERVED])
        share = best[SERVED] / best["offered_tok_s"]
        if share >= OVERLOADED:
            bad.append(f"{key[0]}-{key[1]} dp={key[2]}: {share:.2f}")
    text = f"every cell is overloaded: its best system serves < {OVERLOADED:.0%} of the offer"
    if not n:
        return missing(text)
    return claim(
        text, not bad, f"{n - len(bad)}/{n} cells" + ("; not: " + ", ".join(bad) if bad else "")
    )


def _best_cell_claim(rows, text, metric, num_label, den_label, *, at_least):
    """In at least one cell (dp >= 2): num / den >= at_least."""
    best = None
    for key, cell in sorted(_cells(rows).items(), key=str):
        num, den = one(cell, policy=num_label), one(cell, policy=den_label)
        if key[2] < 2 or num is None or den is None or not den.get(metric):
            continue
        ratio = num[metric] / den[metric]
        if best is None or ratio > best[0]:
            best = (ratio, key)
    if best is None:
        return missing(text)
    ratio, key = best
    return claim(text, ratio >= at_least, f"best {ratio:.2f} ({key[0]}-{key[1]} dp={key[2]})")


def _well_behaved_claim(rows, *, at_least=0.95):
    """Every well-behaved client gets >= ``at_least`` x the service rate it gets under VTC.

    Jain's index over service rates treats a client whose demand is met like one starved:
    when well-behaved clients already get all they ask for, a work-conserving D2LPM hands the
    capacity its cache hits free to the client still asking (the misbehaver), and Jain drops
    though nobody lost anything. This is the per-client check behind that reading."""
    ratios, bad = [], []
    for key, cell in sorted(_cells(rows).items(), key=str):
        d, v = one(cell, policy="D2LPM"), one(cell, policy="VTC")
        if key[2] < 2 or d is None or v is None or not d.get("clients") or not v.get("clients"):
            continue
        skip = set(d.get("misbehaving") or ())
        for client, stats in sorted(d["clients"].items()):
            base = v["clients"].get(client, {}).get("service_rate")
            if client in skip or not base:
                continue
            ratio = stats["service_rate"] / base
            ratios.append(ratio)
            if ratio < at_least:  # three places: 0.948 must not read as 0.95
                bad.append(f"{key[0]}-{key[1]} dp={key[2]} {client}: {ratio:.3f}")
    text = f"every well-behaved client gets ≥ {at_least}× its service rate under VTC"
    if not ratios:
        return missing(text)
    return claim(text, not bad, _detail(len(ratios), "clients", f"min {min(ratios):.3f}", bad))


def _grid_claims(rows):
    inv = [
        {**r, "inv_p99": 1.0 / r["p99_well_behaved_s"]} for r in rows if r.get("p99_well_behaved_s")
    ]
    tot_judge = [r for r in rows if r["workload"] in ("tot", "judge")]
    return [
        _overload_claim(rows),
        _ratio_claim(
            rows, "D2LPM's throughput ≥ VTC's (fair vs fair)", SERVED, "D2LPM", ("VTC",),
            at_least=1.0,
        ),
        _best_cell_claim(
            rows, "D2LPM's throughput ≥ 2× VTC's in some cell", SERVED, "D2LPM", "VTC",
            at_least=2.0,
        ),
        _ratio_claim(
            tot_judge, "ToT and judge: D2LPM's throughput ≥ 0.95× the best unfair baseline",
            SERVED, "D2LPM", UNFAIR, at_least=0.95,
        ),
        _diff_claim(rows, "D2LPM's Jain ≥ VTC's − 0.03", "jain", "D2LPM", ("VTC",), slack=0.03),
        _ratio_claim(
            inv, "well-behaved P99 under D2LPM ≤ under Preble", "inv_p99", "D2LPM",
            ("Preble",), at_least=1.0,
        ),
        _best_cell_claim(
            inv, "well-behaved P99 under D2LPM ≤ 1/3 of Preble's in some cell", "inv_p99",
            "D2LPM", "Preble", at_least=3.0,
        ),
        _well_behaved_claim(rows),  # beyond the issue: what the Jain gap means (docstring)
        # SPEC §0's system view: Jain over the GPU's actual work (extend + 2 × output), where
        # cache hits do not look like unfairness (beyond the issue, reported beside it).
        _diff_claim(
            rows, "D2LPM's Jain on the GPU's actual work ≥ VTC's − 0.03", "jain_actual",
            "D2LPM", ("VTC",), slack=0.03,
        ),
    ]  # fmt: skip


GRID = ClusterExperiment(
    "d2lpm-grid",
    "DLPM Fig. 7",
    "ToT, LLM-as-judge, long-doc QA × S1/S2 × 1–8 GPUs: D2LPM vs RR+LPM, Preble, VTC, "
    "cache-aware (Llama-3.1-8B, A100-80GB)",
    _grid_specs,
    _grid_claims,
    plots=("grid",),
)
