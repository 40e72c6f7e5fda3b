"""Simulator speed: ``vtc-overload`` at full length (600 s virtual) vs wall-clock time.

Target (issue #2): >= 100x faster than real time on one core, for every policy the
experiment compares. Reports virtual seconds per wall second per policy (the scheduler,
the policy, the cost model and the radix cache all run; metrics are not timed).

    python bench/bench_sim_speed.py [--results bench/results] [--date YYYY-MM-DD]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sgl_fair.experiment import stored
from sgl_fair.experiment.single import fresh_copy
from sgl_fair.experiment.vtc import get_experiment
from sgl_fair.policies import make_policy
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker, simulate
from sgl_fair.workloads.traces import generate


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="simulator speed, vtc-overload full length")
    ap.add_argument("--results", type=Path, default=None, help="also store (file or folder)")
    ap.add_argument("--date", default=None, help="the stored file's date (default: today)")
    args = ap.parse_args(argv)
    exp = get_experiment("vtc-overload")
    requests = generate(exp.clients(exp.duration_s), duration_s=exp.duration_s, seed=0)
    cost_model = CostModel.from_names(exp.gpu, exp.model)
    rows = {}
    for spec in exp.policies:
        sched, engine = make_sim_worker(
            policy=make_policy(spec.name, **spec.options),
            cost_model=cost_model,
            kv_tokens=exp.kv_tokens,
            config=exp.scheduler,
        )
        res = simulate(fresh_copy(requests), scheduler=sched, engine=engine, until_s=exp.duration_s)
        rows[spec.label] = {
            "virtual_s": round(res.t_end_s, 1),
            "wall_s": round(res.wall_s, 3),
            "speedup": round(res.speedup, 1),
            "steps": res.stats.num_prefill_steps + res.stats.num_decode_steps,
        }
    worst = min(r["speedup"] for r in rows.values())
    result = {
        "bench": "sim_speed",
        "experiment": exp.name,
        "requests": len(requests),
        "policies": rows,
        "min_speedup": worst,
        "max_speedup": max(r["speedup"] for r in rows.values()),
        "target_speedup": 100,
        "meets_target": worst >= 100,
    }
    print(json.dumps(result, indent=2))
    if args.results is not None:
        path = stored.write(args.results, "bench", "sim-speed", result, date=args.date)
        print(f"stored: {path}")
    return result


if __name__ == "__main__":
    main()
