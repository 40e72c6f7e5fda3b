"""``bros-bicache`` at the paper's one RT rate, full length: the 12 cells its claims read.

The whole experiment (``experiment run bros-bicache``: 5 rates, 72 cells) takes long on a
small machine; its claims read only the paper's setting at 10 RT req/s. This runs those
cells — 4 arms × BE batches 32/256/512, vLLM's prompt-only admission, 60 s — with the
experiment's own ``run_arm`` and ``summarize``, so rows, gains and claims are the
experiment's (about 2 minutes on one core).

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
    ap.add_argument("--rate", type=float, default=PAPER_RATE)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="store here (file or folder)")
    ap.add_argument("--date", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [
        run_arm(arm, args.rate, args.duration, args.seed, setting=PAPER, be_batch=b)
        for b in BE_BATCHES
        for arm in ARM_NAMES
    ]
    result = {
        "experiment": "bros-bicache",
        "cells": f"setting paper, rate {args.rate:g}, BE batches {list(BE_BATCHES)}",
        "seed": args.seed,
        "duration_s": args.duration,
        "rows": rows,
        **summarize(rows, at_rate=args.rate),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.results is not None:
        path = stored.write(args.results, "bench", "bros-bicache-rate", result, date=args.date)
        print(f"stored: {path}")
    else:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
