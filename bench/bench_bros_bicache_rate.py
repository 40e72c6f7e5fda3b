"""``bros-bicache`` at the paper's setting, full length: the cells its claims read.

The whole experiment (``experiment run bros-bicache``: 5 rates, 90 cells) takes long on a
small machine; its claims read only the paper's setting at 10 RT req/s. This runs those
cells — every arm × BE batches 32/256/512, vLLM's prompt-only admission, 60 s — with the
experiment's own ``run_arm`` and ``summarize``, so rows, gains and claims are the
experiment's (about 2 minutes a rate on one core); ``--rate`` may list several rates
(``6,8,10,12,14``: the paper's sweep), whose gains are in ``gains`` per cell.

    python bench/bench_bros_bicache_rate.py [--rate 10] [--duration 60] [--results PATH]
        [--date YYYY-MM-DD]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sgl_fair.experiment import stored
from sgl_fair.experiment.bros_bicache import (
    ARM_NAMES,
    BE_BATCHES,
    PAPER,
    PAPER_RATE,
    run_arm,
    summarize,
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rate",
        default=str(PAPER_RATE),
        help="RT req/s, or several: 6,8,10,12,14 (claims at 10 if listed)",
    )
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="store here (file or folder)")
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rate.split(",")]
    except ValueError:
        ap.error(f"--rate: numbers separated by commas (got {args.rate!r})")
    if not rates or min(rates) <= 0:
        ap.error(f"--rate: every rate must be > 0 (got {args.rate!r})")
    at_rate = PAPER_RATE if PAPER_RATE in rates else rates[0]
    started = stored.provenance(args.date)  # the commit that runs
    t0 = time.perf_counter()
    rows = [
        run_arm(arm, rate, args.duration, args.seed, setting=PAPER, be_batch=b)
        for rate in rates
        for b in BE_BATCHES
        for arm in ARM_NAMES
    ]
    shown = ", ".join(f"{r:g}" for r in rates)
    result = {
        "experiment": "bros-bicache",
        "cells": f"setting paper, rate {shown}, BE batches {list(BE_BATCHES)}",
        "seed": args.seed,
        "duration_s": args.duration,
        "rows": rows,
        **summarize(rows, at_rate=at_rate),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.results is not None:
        path = stored.write(args.results, "bench", "bros-bicache-rate", result, started=started)
        print(f"stored: {path}")
    else:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
