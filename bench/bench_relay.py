"""The relay's CPU per streamed token, with no model in the way (issue 39, item 2).

``bench_sglang_side_by_side.py`` compares our stack with SGLang's on real SGLang servers, but on
a 2-core machine those servers spin both cores, and a change worth 10 % of the router's CPU is
lost in the ±15 % between runs. Here the servers are stand-ins (``tests/worker/
sglang_standin.py``, each its own process: SGLang's ``/generate`` SSE with cumulative
``output_ids``, one token per stream every ``--token-interval`` seconds, our plugin reported
in ``/server_info``), so nearly all the machine is the relay's: our router with its bridges
(``launch --backend sglang --worker-url …``), or SGLang's Rust gateway (``--stacks gateway``,
``cache_aware``), under the side-by-side's client load (a flood tenant keeping F streams in
flight, a victim one; prefix-heavy prompts as ``input_ids``; streaming ``/generate``).

Reported per stack: tokens streamed, the relay's CPU-seconds (psutil, over the load window)
and its CPU per token, also less its fixed cost (CPU per second over ``--idle`` seconds
without load). ``--stacks ours@REV,ours`` compares our code at a git revision with the
checkout's in one run (``bench_sglang_side_by_side.source_at``).

    .venv/bin/python bench/bench_relay.py [--duration 20] [--flood 24]
        [--token-interval 0.04] [--stacks gateway,ours] [--json runs/relay.json]
        [--results bench/results/relay-DATE.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "worker"))

import bench_sglang_side_by_side as sbs  # noqa: E402
import live_rig  # noqa: E402  (tests/sglang, put on the path by sbs)

VOCAB = 32000  # the stand-ins echo no prompt tokens: any ids do


def _standin(policy: str, interval_s: float, urls: Any) -> None:
    """A stand-in SGLang server, forever (a process of its own)."""
    from sglang_standin import StandInSGLang

    info = {"sgl_fair": {"policy": policy, "opts": {}}}
    with StandInSGLang(info=info, token_interval_s=interval_s, record=False) as server:
        urls.put(server.url)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


def start_standins(n: int, args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_standin, args=(args.policy, args.token_interval, q),
                         daemon=True) for _ in range(n)]  # fmt: skip
    for p in procs:
        p.start()
    return procs, [q.get(timeout=60) for _ in procs]


def run_gateway(urls: list[str], tmp: Path, args: argparse.Namespace,
                servers: list[int]) -> dict[str, Any]:  # fmt: skip
    port, prom = live_rig.free_port(), live_rig.free_port()
    log = tmp / "gateway.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]  # fmt: skip
    with open(log, "w") as out:
        gw = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        sbs._wait_ready(url, gw, log, 120)
        groups = {"gateway": [gw.pid], "servers": servers}
        return sbs.measure(url, groups, ("gateway",), args, VOCAB)
    finally:
        sbs._stop(gw, signal.SIGTERM)


def run_ours(urls: list[str], tmp: Path, args: argparse.Namespace, rev: str | None,
             extra: list[str], servers: list[int]) -> dict[str, Any]:  # fmt: skip
    tenants = tmp / "tenants.toml"
    tenants.write_text("".join(
        f'[[tenant]]\nname = "{t}"\napi_keys = ["sk-{t}"]\n' for t in sbs.TENANTS
    ))  # fmt: skip
    port = live_rig.free_port()
    log = tmp / "launch.log"
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--backend", "sglang",
           *[x for u in urls for x in ("--worker-url", u)], "--schedule-policy", args.policy,
           "--port", str(port), "--tenants", str(tenants), "--heartbeat-timeout", "30",
           *extra]  # fmt: skip
    env = dict(os.environ)
    if rev is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(sbs.source_at(rev, tmp)), env.get("PYTHONPATH", "")]
        )
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        sbs._wait_ready(url, proc, log, 120)
        groups = {"router": [proc.pid], "servers": servers}
        return sbs.measure(url, groups, ("router",), args, VOCAB)
    finally:
        sbs._stop(proc)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.load_args(ap, duration=20.0, idle=3.0, peer="gateway", stored_as="relay-DATE.json")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--token-interval", type=float, default=0.04,
                    help="seconds between a stream's tokens at the stand-ins")  # fmt: skip
    args = ap.parse_args(argv)
    from sgl_fair.experiment import stored

    started = stored.provenance()  # the commit that runs, whatever the checkout does meanwhile
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "results")}
    }
    procs, urls = start_standins(args.servers, args)
    pids = [p.pid for p in procs]
    try:
        with tempfile.TemporaryDirectory(prefix="relay-") as d:
            for stack in args.stacks.split(","):
                tmp = Path(d) / stack
                tmp.mkdir()
                if stack == "gateway":
                    results[stack] = run_gateway(urls, tmp, args, pids)
                else:
                    name, _, mode = stack.partition("+")
                    rev = name.partition("@")[2] or None
                    extra = ["--bridges", mode] if mode else []
                    results[stack] = run_ours(urls, tmp, args, rev, extra, pids)
                r = results[stack]
                print(f"{stack:14s} tokens {r['tokens']:6d}  relay {r['relay_cpu_s']:.2f} CPU-s  "
                      f"{r['relay_cpu_ms_per_token']:.4f} ms/token "
                      f"({r['relay_busy_cpu_ms_per_token']:.4f} less idle)",
                      flush=True)  # fmt: skip
                time.sleep(1.0)
    finally:
        for p in procs:
            p.terminate()
    if "gateway" in results:
        g = results["gateway"]
        for name in [k for k in results if k.startswith("ours")]:
            o = results[name]
            results.setdefault("ratios", {})[name] = {
                "relay_cpu_per_token": round(
                    o["relay_cpu_ms_per_token"] / g["relay_cpu_ms_per_token"], 3),
                "relay_busy_cpu_per_token": round(
                    o["relay_busy_cpu_ms_per_token"] / g["relay_busy_cpu_ms_per_token"], 3),
            }  # fmt: skip
        print(f"ours / gateway: {results.get('ratios')}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.results is not None:
        print(f"stored: {stored.write(args.results, 'bench', 'relay', results, started=started)}")
    return results


if __name__ == "__main__":
    main()
