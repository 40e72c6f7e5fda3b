"""Scheduling quality from ``d2lpm-grid`` at dp=4: D2LPM against VTC, the best unfair
baseline and Preble, on ToT-S2 and Judge-S1 (full-length runs).

Targets (issue #3): D2LPM throughput ≥ 2× VTC's and ≥ 0.95× the best unfair baseline's;
Jain ≥ VTC's − 0.02; well-behaved P99 ≤ 1/5 of Preble's. Ratios come from one run each,
measured together. ``--seconds`` shortens the runs.
"""

from __future__ import annotations

import argparse
import json
import time

from sgl_fair.experiment.cluster import EXPERIMENTS, Overrides, apply_overrides
from sgl_fair.experiment.cluster_grid import FULL_SECONDS, UNFAIR
from sgl_fair.experiment.cluster_runs import run_many

CELLS = (("tot", "s2"), ("judge", "s1"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=FULL_SECONDS)
    ap.add_argument("--dp", type=int, default=4)
    args = ap.parse_args(argv)
    specs = []
    for workload, scenario in CELLS:
        cell = apply_overrides(
            EXPERIMENTS["d2lpm-grid"].build(False, 0),
            Overrides(dp=args.dp, workload=workload, scenario=scenario),
        )
        specs += [s.replace(duration_s=args.seconds) for s in cell]
    t0 = time.perf_counter()
    rows = run_many(specs)
    out: dict = {"dp": args.dp, "seconds": args.seconds, "cells": {}}
    for workload, scenario in CELLS:
        cell = {
            r["policy"]: r for r in rows if (r["workload"], r["scenario"]) == (workload, scenario)
        }
        d, vtc, preble = cell["D2LPM"], cell["VTC"], cell["Preble"]
        best = max((cell[p] for p in UNFAIR), key=lambda r: r["throughput_tok_s"])
        out["cells"][f"{workload}-{scenario}"] = {
            "throughput_tok_s": {p: round(r["throughput_tok_s"]) for p, r in cell.items()},
            "jain": {p: round(r["jain"], 3) for p, r in cell.items()},
            "p99_well_behaved_s": {p: round(r["p99_well_behaved_s"], 1) for p, r in cell.items()},
            "cache_hit_rate": {p: round(r["cache_hit_rate"], 3) for p, r in cell.items()},
            "d2lpm_vs_vtc_throughput": round(d["throughput_tok_s"] / vtc["throughput_tok_s"], 3),
            "best_unfair": best["policy"],
            "d2lpm_vs_best_unfair_throughput": round(
                d["throughput_tok_s"] / best["throughput_tok_s"], 3
            ),
            "d2lpm_minus_vtc_jain": round(d["jain"] - vtc["jain"], 3),
            "d2lpm_over_preble_p99": round(
                d["p99_well_behaved_s"] / preble["p99_well_behaved_s"], 3
            ),
        }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
