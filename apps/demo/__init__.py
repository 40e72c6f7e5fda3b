"""``make demo``: the live system end to end on this machine, in about a minute and a half.

1. ``python -m sgl_fair.launch --dp 4`` on the simulated engine (4 × H100 serving
   Llama-3.1-8B in real time), D2LPM router, DLPM workers, four API-key tenants;
2. a 60-second load test (``python -m sgl_fair.loadtest``): Tree-of-Thoughts programs,
   scenario S2 — tenant ``c0`` sends trees with ~2,000 extra prompt tokens each;
3. the fairness table: per tenant programs, calls, tokens, service share and program latency
   P50/P99; throughput and Jain's index; then the server shuts down.

``python -m sgl_fair.demo bros`` (``make demo-bros``) is the second demo: real-time chat
beside a best-effort batch job, FCFS vs BROS (``demo/bros.py``). ``python -m sgl_fair.demo
sglang`` (``make demo-sglang``) is the third: a flooding tenant beside a well-behaved one on a
real SGLang server, ``fcfs`` vs ``vtc`` vs ``dlpm`` (``demo/sglang_flood.py``).

Flags: ``--duration S``, ``--dp N``, ``--router-policy``/``--schedule-policy`` (compare e.g.
``--router-policy rr --schedule-policy lpm``), ``--gpu``, ``--model``, ``--rate-scale``,
``--out DIR``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sgl_fair.demo.server import serving

CLIENTS = 4
GPU, MODEL = "H100-80GB", "Llama-3.1-8B"
# Programs per second per client = the workload's base rate x dp x RATE_SCALE. At 2.0 on four
# simulated H100s the cluster runs near capacity, c0's long prefixes would take the lion's share
# of prefill under plain locality, and the load generator still fits on 2 CPU cores.
RATE_SCALE = 2.0
STREAM_INTERVAL = 32  # SSE chunk every 32 tokens: keeps the load generator off the CPU's limit


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bros"]:  # make demo-bros: RT chat beside a BE batch job (demo/bros.py)
        from sgl_fair.demo.bros import main as bros_main

        return bros_main(argv[1:])
    if argv[:1] == ["sglang"]:  # make demo-sglang: a flood on a real SGLang server (sglang_flood)
        from sgl_fair.demo.sglang_flood import main as sglang_main

        return sglang_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m sgl_fair.demo", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--router-policy", default="d2lpm")
    p.add_argument("--schedule-policy", default="dlpm")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--gpu", default=GPU)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--rate-scale", type=float, default=RATE_SCALE)
    args = p.parse_args(argv)
    if args.duration <= 0 or args.dp < 1:
        p.error("--duration must be > 0 and --dp >= 1")

    from sgl_fair.loadtest import LoadTestConfig, print_fairness, run_loadtest

    work = Path(tempfile.mkdtemp(prefix="sgl-fair-demo-"))
    keys = {f"c{i}": f"sk-demo-{i}-{os.urandom(6).hex()}" for i in range(CLIENTS)}
    tenants = work / "tenants.toml"
    tenants.write_text(
        "".join(f'[[tenant]]\nname = "{c}"\napi_keys = ["{k}"]\n\n' for c, k in keys.items())
    )
    log_path = work / "server.log"
    args_ = [
        "--dp", str(args.dp), "--gpu", args.gpu, "--model", args.model,
        "--router-policy", args.router_policy, "--schedule-policy", args.schedule_policy,
        "--tenants", str(tenants),
    ]  # fmt: skip
    print("$ python -m sgl_fair.launch " + " ".join(args_), flush=True)
    try:
        with serving(args_, log_path) as url:
            print(f"server ready at {url}; ToT S2, {CLIENTS} tenants, {args.duration:.0f} s")
            config = LoadTestConfig(
                url=url,
                workload="tot",
                scenario="s2",
                clients=CLIENTS,
                duration_s=args.duration,
                rate_scale=args.rate_scale,
                api_keys=keys,
                out=Path(args.out),
                stream_interval=STREAM_INTERVAL,
            )
            from sgl_fair.loadtest import progress_bar

            with progress_bar(sys.stderr.isatty()) as update:
                results = run_loadtest(config, on_update=update)
            print_fairness(results)
            print(f"report: {results['paths']['report']}")
    finally:
        print(f"server stopped (log: {log_path})")
    return 0 if results["totals"]["calls_ok"] else 1
