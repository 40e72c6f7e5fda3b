"""One D2LPM grid cell live (issue 15, item 4): ToT S2 on 4 GPUs, every grid pairing, through
``python -m sgl_fair.launch --dp 4`` (sim backend, wall clock) and the load-test harness,
against the cluster simulator on the identical cell.

Claim: the live runs order the pairings by throughput as the simulator does, and each live
throughput is within ±15 % of the simulator's.

Per pairing of ``GRID_COMBOS`` (D2LPM, RR+LPM, Preble, VTC, CacheAware+LPM):

* **sim**: ``cluster_runs.run_one(RunSpec(combo, 4, "tot", "s2", D, gpu, model, rate_scale,
  seed))``;
* **live**: ``launch --dp 4 --router-policy R --schedule-policy L [opts] --time-scale S
  --share-guard off --sim-eos off --sim-text off`` (the simulator's scheduler: no share
  guard; every call runs to ``max_new_tokens``) and ``sgl_fair.loadtest`` (4 clients, ToT S2,
  the same seed, SSE every 32 tokens as the demo).

Throughput is the simulator's ``throughput_tok_s`` (``metrics.throughput``): the full prompt
of every call (cached prefix included) plus its output tokens, over first arrival → last
finish. The live row's ``throughput_tok_s`` is the same function over the client's
observations; it is cross-checked against a recount from ``requests.jsonl`` (ok calls'
prompt + completion tokens over the same span).

**Time scale.** ``--time-scale S`` is simulated seconds per wall second: a step the cost
model says takes ``d`` s takes ``d / S`` wall seconds. The CPU work (router, HTTP, the
workers' scheduling, the load generator) does not scale, so on 2 cores ``S < 1`` shrinks it
relative to the simulated GPU time. To keep the simulated-time workload unchanged, the load
generator runs ``rate_scale × S`` (programs per wall second) for ``D / S`` wall seconds: the
Gamma inter-arrival draws scale exactly, so wall arrival ``t`` is simulated time ``t × S``
and the programs are the simulator's (checked: ids, start times, call plans). Back in
simulated units: throughput = wall tokens/s ÷ S, latency = wall seconds × S.

Keeping up is reported per run: the router's event-loop lag (``/metrics``
``sgl_fair_router_loop_lag_seconds``, sampled every second), the load generator's own loop
lag and send lag, and the live makespan against the simulator's.

Run: ``.venv/bin/python bench/bench_live_cell.py [--duration 15] [--time-scale 0.25]
[--combos D2LPM,VTC] [--json] [--out runs/bench-live-cell]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLIENTS, DP = 4, 4
WORKLOAD, SCENARIO = "tot", "s2"
GPU, MODEL = "H100-80GB", "Llama-3.1-8B"  # the demo's
RATE_SCALE = 2.5  # cluster_base.RATE_SCALE["tot", "s2"]: the grid's load for this cell
DURATION_S = 15.0  # simulated s of arrivals: the grid's quick cell at dp 4 (60 s / dp)
# On 2 cores the router, 4 workers and the load generator fall behind at 1 (live/sim ~0.91-0.94
# at 30 s, 0.96-0.98 at 0.5); at 0.25 the router's loop lag stays ~10 ms (P90) and live ~ sim.
TIME_SCALE = 0.25
STREAM_INTERVAL = 32
TOLERANCE = 0.15
TIE = 0.01  # sim throughputs within 1 % count as a tie for the tie-tolerant order


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from sgl_fair.workloads.combos import GRID_COMBOS

    labels = [c.label for c in GRID_COMBOS]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=DURATION_S, help="simulated s of arrivals")
    p.add_argument("--rate-scale", type=float, default=RATE_SCALE)
    p.add_argument("--gpu", default=GPU)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--time-scale", type=float, default=TIME_SCALE, help="simulated s per wall s")
    p.add_argument("--combos", default=",".join(labels), help="comma-separated labels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="runs/bench-live-cell")
    args = p.parse_args(argv)
    combos = [c.strip() for c in args.combos.split(",") if c.strip()]
    unknown = [c for c in combos if c not in labels]
    if unknown or not combos:
        p.error(f"--combos: unknown {unknown} (known: {', '.join(labels)})")
    if not (args.duration > 0 and args.rate_scale > 0 and 0 < args.time_scale < math.inf):
        p.error("--duration, --rate-scale and --time-scale must be > 0 (and finite)")
    if args.seed < 0:
        p.error("--seed must be >= 0")
    args.combos = [c for c in GRID_COMBOS if c.label in combos]
    return args


# ---------------------------------------------------------------------------- simulator side


def sim_clients(args: argparse.Namespace) -> list:
    from sgl_fair.workloads.programs import workload

    return workload(
        WORKLOAD, SCENARIO, dp=DP, num_clients=CLIENTS, rate_scale=args.rate_scale,
        duration_s=args.duration,
    )  # fmt: skip


def live_clients(args: argparse.Namespace) -> list:
    """What ``run_loadtest`` builds for the live config (``loadtest.run._clients``)."""
    from sgl_fair.workloads.harness import build_clients

    return build_clients(
        WORKLOAD, SCENARIO, num_clients=CLIENTS, duration_s=args.duration / args.time_scale,
        dp=DP, rate_scale=args.rate_scale * args.time_scale,
    )  # fmt: skip


def check_same_programs(args: argparse.Namespace) -> dict[str, Any]:
    """The live load test's programs are the simulator's, wall times × S = simulated times."""
    from sgl_fair.workloads.programs import generate_programs

    s = args.time_scale
    sim = generate_programs(sim_clients(args), args.duration, seed=args.seed)
    live = generate_programs(live_clients(args), args.duration / s, seed=args.seed)
    problems = []
    if len(sim) != len(live):
        problems.append(f"{len(sim)} simulated vs {len(live)} live programs")
    for a, b in zip(sim, live, strict=False):
        if (a.program_id, a.client, a.calls) != (b.program_id, b.client, b.calls):
            problems.append(f"{a.program_id} differs from {b.program_id}")
        elif abs(a.start_s - b.start_s * s) > 1e-6 * max(1.0, a.start_s):
            problems.append(f"{a.program_id} starts at {a.start_s} vs {b.start_s * s} (live)")
        if any(c.delay_s for c in a.calls):
            problems.append(f"{a.program_id} has think times (they would not scale)")
    per_client: dict[str, int] = {}
    for p in sim:
        per_client[p.client] = per_client.get(p.client, 0) + 1
    return {
        "same": not problems,
        "problems": problems[:5],
        "programs": len(sim),
        "calls": sum(p.num_calls for p in sim),
        "per_client": per_client,
    }


def run_sim(combo, args: argparse.Namespace) -> dict[str, Any]:
    from sgl_fair.experiment.cluster_runs import RunSpec, run_one

    t = time.perf_counter()
    row = run_one(
        RunSpec(
            combo, DP, WORKLOAD, SCENARIO, args.duration, gpu=args.gpu, model=args.model,
            num_clients=CLIENTS, rate_scale=args.rate_scale, seed=args.seed,
        )
    )  # fmt: skip
    return {
        "throughput_tok_s": row["throughput_tok_s"],
        "jain": row["jain"],
        "p99_well_behaved_s": row["p99_well_behaved_s"],
        "cache_hit_rate": row["cache_hit_rate"],
        "makespan_s": row["makespan_s"],
        "num_calls": row["num_calls"],
        "unfinished_calls": row["unfinished_calls"],
        "num_retractions": row["num_retractions"],
        "gpu_busy_frac": row["gpu_busy_frac"],
        "kv_tokens": row["kv_tokens"],
        "wall_s": round(time.perf_counter() - t, 1),
    }


# ---------------------------------------------------------------------------- live side


def server_args(combo, args: argparse.Namespace) -> list[str]:
    out = [
        "--dp", str(DP), "--backend", "sim", "--gpu", args.gpu, "--model", args.model,
        "--router-policy", combo.router, "--schedule-policy", combo.local,
        "--time-scale", f"{args.time_scale:g}",
        "--share-guard", "off", "--sim-eos", "off", "--sim-text", "off",
    ]  # fmt: skip
    for k, v in dict(combo.router_opts).items():
        out += ["--router-policy-opt", f"{k}={v}"]
    for k, v in dict(combo.local_opts).items():
        out += ["--schedule-policy-opt", f"{k}={v}"]
    return out


class LagPoller(threading.Thread):
    """Samples the router's event-loop lag gauge from ``/metrics`` every ``period_s``."""

    PATTERN = re.compile(r"^sgl_fair_router_loop_lag_seconds\s+(\S+)$", re.M)

    def __init__(self, url: str, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s = url + "/metrics", period_s
        self.samples: list[float] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=5) as client:
            while not self.stop_event.wait(self.period_s):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    m = self.PATTERN.search(client.get(self.url).text)
                    if m:
                        self.samples.append(float(m.group(1)))

    def summary(self) -> dict[str, float | None]:
        self.stop_event.set()
        self.join(10)
        xs = sorted(self.samples)
        return {
            "router_lag_max_s": xs[-1] if xs else None,
            "router_lag_p90_s": xs[int(0.9 * (len(xs) - 1))] if xs else None,
        }


def recount_tok_s(requests_path: Path) -> float | None:
    """Prompt + completion tokens of the ok calls over first arrival → last finish (wall)."""
    tokens, arrivals, finishes = 0, [], []
    with requests_path.open() as f:
        for line in f:
            c = json.loads(line)
            if c["send_s"] is None:
                continue
            arrivals.append(c["arrival_s"])
            if c["state"] == "ok":
                tokens += (c["prompt_tokens"] or c["input_len"]) + (
                    c["completion_tokens"] or len(c["output_ids"])
                )
                finishes.append(c["finish_s"])
    if not finishes or max(finishes) <= min(arrivals):
        return None
    return tokens / (max(finishes) - min(arrivals))


def run_live(combo, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from sgl_fair.demo.server import serving
    from sgl_fair.loadtest import LoadTestConfig, run_loadtest

    s = args.time_scale
    out.mkdir(parents=True, exist_ok=True)
    wall_duration = args.duration / s
    t = time.perf_counter()
    with serving(server_args(combo, args), out / "server.log") as url:
        poller = LagPoller(url)
        poller.start()
        try:
            res = run_loadtest(
                LoadTestConfig(
                    url=url, workload=WORKLOAD, scenario=SCENARIO, clients=CLIENTS,
                    duration_s=wall_duration, rate_scale=args.rate_scale * s, dp=DP,
                    seed=args.seed, out=out / "loadtest", stream_interval=STREAM_INTERVAL,
                    drain_timeout_s=max(60.0, wall_duration),
                )
            )  # fmt: skip
        finally:
            lag = poller.summary()
    row, info = res["row"], res["run"]["server_info"]
    recount = recount_tok_s(Path(res["paths"]["requests"]))
    p99 = row["p99_well_behaved_s"]
    return {
        "throughput_tok_s": row["throughput_tok_s"] / s,
        "throughput_tok_s_recount": recount / s if recount is not None else None,
        "jain": row["jain"],
        "p99_well_behaved_s": p99 * s if p99 is not None else None,
        "cache_hit_rate": row["cache_hit_rate"],
        "makespan_s": row["makespan_s"] * s,
        "num_calls": row["num_calls"],
        "failed_calls": row["failed_calls"],
        "unfinished_calls": row["unfinished_calls"] + row["unsent_calls"],
        "policy": row["policy"],
        "kv_tokens": info.get("max_total_num_tokens"),
        "loadgen_loop_lag_max_s": row["max_loop_lag_s"],
        "send_lag_max_s": row["max_send_lag_s"],
        **lag,
        "wall_s": round(time.perf_counter() - t, 1),
    }


# ---------------------------------------------------------------------------- the table


def order(rows: Sequence[dict[str, Any]], side: str) -> list[str]:
    """Labels by ``side``'s throughput, highest first."""
    ranked = sorted(rows, key=lambda r: -(r[side]["throughput_tok_s"] or 0.0))
    return [r["label"] for r in ranked]


def compare(
    rows: Sequence[dict[str, Any]], *, tolerance: float = TOLERANCE, tie: float = TIE
) -> dict[str, Any]:
    """Per row ``{"label", "sim": {...}, "live": {...}}``: live/sim ratios, both orders and
    the claims. A pair the live run orders differently is *discordant*; it is a *tie* when
    the simulator's two throughputs are within ``tie`` of each other."""
    out_rows = []
    for r in rows:
        sim, live = r["sim"]["throughput_tok_s"], r["live"]["throughput_tok_s"]
        ratio = live / sim if sim else None
        ok = ratio is not None and abs(ratio - 1) <= tolerance
        out_rows.append({**r, "ratio": ratio, "within": ok})
    sim_order, live_order = order(rows, "sim"), order(rows, "live")
    by = {r["label"]: r for r in rows}
    discordant, ties = [], []
    for i, a in enumerate(sim_order):
        for b in sim_order[i + 1 :]:
            if live_order.index(a) > live_order.index(b):
                sa, sb = by[a]["sim"]["throughput_tok_s"], by[b]["sim"]["throughput_tok_s"]
                gap = (sa - sb) / sb if sb else math.inf
                (ties if gap <= tie else discordant).append(f"{a}>{b} (sim +{100 * gap:.1f}%)")
    return {
        "rows": out_rows,
        "sim_order": sim_order,
        "live_order": live_order,
        "orders_match": sim_order == live_order,
        "orders_match_up_to_ties": not discordant,
        "discordant": discordant,
        "swapped_ties": ties,
        "within_tolerance": all(r["within"] for r in out_rows),
        "tolerance": tolerance,
        "tie": tie,
    }


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'pairing':<15} {'sim tok/s':>10} {'live tok/s':>10} {'live/sim':>8} {'±tol':>4} "
        f"{'jain sim/live':>13} {'P99wb s sim/live':>16} {'hit sim/live':>12} "
        f"{'mkspan sim/live':>15} {'lag rtr/gen s':>13}"
    ]
    for r in result["rows"]:
        s, v = r["sim"], r["live"]
        lag = f"{_f(v.get('router_lag_max_s'), '.2f')}/{_f(v.get('loadgen_loop_lag_max_s'), '.2f')}"
        lines.append(
            f"{r['label']:<15} {s['throughput_tok_s']:>10.0f} {v['throughput_tok_s']:>10.0f} "
            f"{_f(r['ratio'], '.3f'):>8} {'ok' if r['within'] else 'NO':>4} "
            f"{_f(s['jain'], '.3f'):>6}/{_f(v['jain'], '.3f'):<6} "
            f"{_f(s['p99_well_behaved_s'], '.2f'):>8}/{_f(v['p99_well_behaved_s'], '.2f'):<7} "
            f"{_f(s['cache_hit_rate'], '.3f'):>6}/{_f(v['cache_hit_rate'], '.3f'):<5} "
            f"{s['makespan_s']:>7.1f}/{v['makespan_s']:<7.1f} "
            f"{lag:>13}"
        )
    tol = f"±{100 * result['tolerance']:.0f}%"
    lines += [
        f"sim order:  {' > '.join(result['sim_order'])}",
        f"live order: {' > '.join(result['live_order'])}",
        f"orders match: {'yes' if result['orders_match'] else 'no'}"
        + (
            ""
            if result["orders_match"]
            else f" (up to {100 * result['tie']:.0f}% ties: "
            f"{'yes' if result['orders_match_up_to_ties'] else 'no'}; discordant "
            f"{result['discordant'] or 'none'}; swapped ties {result['swapped_ties'] or 'none'})"
        ),
        f"live within {tol} of sim: {'yes' if result['within_tolerance'] else 'no'}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    log = sys.stderr
    programs = check_same_programs(args)
    print(
        f"cell: {WORKLOAD} {SCENARIO} dp={DP} {args.gpu} {args.model} rate_scale "
        f"{args.rate_scale:g} seed {args.seed}, {args.duration:g} simulated s of arrivals; live "
        f"at time-scale {args.time_scale:g} ({args.duration / args.time_scale:g} wall s); "
        f"{programs['programs']} programs {programs['per_client']}, {programs['calls']} calls; "
        f"live programs = simulator's: {programs['same']} {programs['problems'] or ''}",
        file=log,
        flush=True,
    )
    rows = []
    for combo in args.combos:
        sim = run_sim(combo, args)
        print(f"  {combo.label}: sim {sim['throughput_tok_s']:.0f} tok/s", file=log, flush=True)
        rows.append({"label": combo.label, "sim": sim})
    for row, combo in zip(rows, args.combos, strict=True):
        safe = re.sub(r"[^A-Za-z0-9]+", "-", combo.label).strip("-").lower()
        print(f"  {combo.label}: live ...", file=log, end="", flush=True)
        row["live"] = run_live(combo, args, out / safe)
        print(f" {row['live']['throughput_tok_s']:.0f} tok/s", file=log, flush=True)
    result = compare(rows, tolerance=args.tolerance)
    result.update(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{os.cpu_count()} cores",
        cell={
            "workload": WORKLOAD, "scenario": SCENARIO, "dp": DP, "clients": CLIENTS,
            "gpu": args.gpu, "model": args.model, "rate_scale": args.rate_scale,
            "seed": args.seed, "duration_s": args.duration, "time_scale": args.time_scale,
        },
        programs=programs,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return result


if __name__ == "__main__":
    main()
