"""Simulator speed: ``vtc-overload`` at full length (600 s virtual) vs wall-clock time.

Target (issue #2): >= 100x faster than real time on one core, for every policy the
experiment compares. Reports virtual seconds per wall second per policy (the scheduler,
the policy, the cost model and the radix cache all run; metrics are not timed).
"""

from __future__ import annotations

import json

from sgl_fair.experiment.single import fresh_copy
from sgl_fair.experiment.vtc import get_experiment
from sgl_fair.policies import make_policy
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker, simulate
from sgl_fair.workloads.traces import generate


def main() -> dict:
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
        "target_speedup": 100,
        "meets_target": worst >= 100,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
