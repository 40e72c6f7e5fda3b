"""``python -m sgl_fair.experiment`` — run the papers' experiments on the simulator.

    python -m sgl_fair.experiment list
    python -m sgl_fair.experiment run NAME [--quick] [--out DIR] [--json] [--seed N]
        [--results PATH [--date YYYY-MM-DD]]
        [--dp N] [--router P] [--local P] [--workload W] [--scenario s1|s2|none]
        [--gpu G] [--model M] [--jobs N]          (flags: cluster experiments only;
                                                   fairserve-apps takes --dp and
                                                   --scenario paper|benign-overload|abuse-overload)
    python -m sgl_fair.experiment replay --trace FILE --policy P
        [--gpu G --model M --tp N --kv-tokens N --policy-opt KEY=VALUE ...] [--json]

Bad input (an unknown name, a malformed trace line, a bad option) prints one
line naming the problem and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from sgl_fair.experiment import stored
from sgl_fair.experiment.show import print_claims, print_table

EXIT_USAGE = 2
PROG = "python -m sgl_fair.experiment"


class UsageError(Exception):
    """A user mistake: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Run sgl-fair experiments on the simulated engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sub.add_parser("list", help="list the named experiments")

    run = sub.add_parser("run", help="run a named experiment")
    run.add_argument("name")
    run.add_argument("--quick", action="store_true", help="shorter run, same rates")
    run.add_argument("--out", type=Path, default=None, help="output folder (default runs/NAME)")
    run.add_argument("--json", action="store_true", help="print results JSON on stdout")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also store rows and claims with date, commit and machine: a .json file, or a "
        "folder (e.g. bench/results) for NAME[-quick]-DATE.json",
    )
    run.add_argument("--date", default=None, help="the stored file's date (default: today, UTC)")
    cluster = run.add_argument_group("cluster experiments (router + N workers)")
    cluster.add_argument("--dp", type=int, default=None, help="number of workers (GPUs)")
    cluster.add_argument("--router", default=None, help="router policy, e.g. d2lpm")
    cluster.add_argument("--local", default=None, help="worker policy, e.g. dlpm")
    cluster.add_argument("--workload", default=None, help="tot | judge | longqa | chat | mixed")
    cluster.add_argument(
        "--scenario",
        default=None,
        help="s1 | s2 | none (fairserve-apps: paper | benign-overload | abuse-overload)",
    )
    cluster.add_argument("--gpu", default=None)
    cluster.add_argument("--model", default=None)
    cluster.add_argument("--jobs", type=int, default=None, help="processes (default: CPUs)")

    replay = sub.add_parser("replay", help="replay a JSONL trace through one simulated worker")
    replay.add_argument("--trace", type=Path, required=True)
    replay.add_argument("--policy", required=True)
    replay.add_argument("--policy-opt", action="append", default=[], metavar="KEY=VALUE")
    replay.add_argument("--gpu", default="A10G-24GB")
    replay.add_argument("--model", default="Llama-2-7B")
    replay.add_argument("--tp", type=int, default=None)
    replay.add_argument("--kv-tokens", type=int, default=None)
    replay.add_argument("--max-running-requests", type=int, default=256)
    replay.add_argument("--chunked-prefill-size", type=int, default=8192)
    replay.add_argument("--window-s", type=float, default=60.0)
    replay.add_argument("--seed", type=int, default=0)
    replay.add_argument("--json", action="store_true")
    return parser


# ---------------------------------------------------------------- commands


_CLUSTER_FLAGS = ("dp", "router", "local", "workload", "scenario", "gpu", "model", "jobs")


def cmd_list() -> int:
    from sgl_fair.experiment.registry import EXPERIMENTS

    width = max(len(e.name) for e in EXPERIMENTS)
    for exp in EXPERIMENTS:
        print(f"{exp.name:<{width}}  {exp.figure:<12} {exp.description}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from sgl_fair.experiment.registry import EXPERIMENTS, RunOptions

    entry = _user_value(EXPERIMENTS.get, args.name)
    given = {f: getattr(args, f) for f in _CLUSTER_FLAGS if getattr(args, f) is not None}
    foreign = [f"--{f}" for f in given if f not in entry.flags]
    if foreign:
        raise UsageError(f"{', '.join(foreign)}: only for cluster experiments, not {args.name}")
    _check_flags(args)
    if args.date is not None and args.results is None:
        raise UsageError("--date: only with --results")
    if args.date is not None:
        _user_value(dt.date.fromisoformat, args.date)
    if entry.check is not None:
        _user_value(entry.check, given)
    options = RunOptions(quick=args.quick, seed=args.seed, json=args.json, flags=given)
    command = [PROG, *getattr(args, "argv", sys.argv[1:])]
    started = stored.provenance(args.date, command) if args.results is not None else None
    result = _user_value(lambda: entry.run(options))
    out = args.out or Path("runs") / entry.name
    paths = entry.write(result, out)
    if args.results is not None:  # with the provenance of the code that ran (its start)
        paths["stored"] = stored.write(
            args.results,
            "experiment",
            entry.name,
            result.to_json(),
            quick=args.quick,
            date=args.date,
            command=command,
            started=started,
        )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    elif entry.show is not None:
        entry.show(result, paths)
    else:
        print_table(f"{entry.name} ({entry.figure}) — {entry.description}", result.rows)
        print_claims(result.claims)
        print(f"results: {paths['results']}")
    if "stored" in paths and not args.json:
        print(f"stored: {paths['stored']}")
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The narrowing flags' values that mean the same for every experiment (each checked only
    where given); an entry's ``check`` does its own (``--scenario``'s names)."""
    from sgl_fair.policies import policy_names
    from sgl_fair.router import router_policy_names
    from sgl_fair.worker.sim.hardware import get_gpu, get_model
    from sgl_fair.workloads.programs import WORKLOADS

    if args.dp is not None and not 1 <= args.dp <= 64:
        raise UsageError(f"--dp must be between 1 and 64 (got {args.dp})")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1 (got {args.jobs})")
    if args.router is not None and args.router not in router_policy_names():
        raise UsageError(
            f"--router: unknown policy {args.router!r} (known: {', '.join(router_policy_names())})"
        )
    if args.local is not None and args.local not in policy_names():
        raise UsageError(
            f"--local: unknown policy {args.local!r} (known: {', '.join(policy_names())})"
        )
    if args.workload is not None and args.workload not in WORKLOADS:
        raise UsageError(f"--workload: unknown {args.workload!r} (known: {', '.join(WORKLOADS)})")
    if args.gpu is not None:
        _user_value(get_gpu, args.gpu)
    if args.model is not None:
        _user_value(get_model, args.model)


def cmd_replay(args: argparse.Namespace) -> int:
    from sgl_fair import metrics
    from sgl_fair.cost import WeightedTokens
    from sgl_fair.experiment.single import predictor_of
    from sgl_fair.policies import make_policy
    from sgl_fair.worker.scheduler import SchedulerConfig
    from sgl_fair.worker.sim.cost_model import CostModel
    from sgl_fair.worker.sim.runner import make_sim_worker, simulate
    from sgl_fair.workloads.traces import load_trace

    if args.kv_tokens is not None and args.kv_tokens < 1:
        raise UsageError(f"--kv-tokens must be >= 1 (got {args.kv_tokens})")
    if args.window_s <= 0:
        raise UsageError(f"--window-s must be > 0 (got {args.window_s})")
    if not args.trace.is_file():
        raise UsageError(f"--trace: no such file: {args.trace}")
    options = _parse_policy_opts(args.policy_opt)
    policy = _user_value(lambda: make_policy(args.policy, **options))
    cost_model = _user_value(lambda: CostModel.from_names(args.gpu, args.model, tp=args.tp))
    config = _user_value(
        lambda: SchedulerConfig(
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
        )
    )
    requests = _user_value(lambda: load_trace(args.trace, seed=args.seed))
    sched, engine = make_sim_worker(
        policy=policy, cost_model=cost_model, kv_tokens=args.kv_tokens, config=config
    )
    result = simulate(requests, scheduler=sched, engine=engine)
    cost = WeightedTokens()
    row = {
        "policy": args.policy,
        **metrics.summarize(result.log.events, result.records(), cost, window_s=args.window_s),
        "sim_time_s": result.t_end_s,
        "sim_wall_s": round(result.wall_s, 3),
        "kv_tokens": result.kv_capacity_tokens,
        "worker": cost_model.describe(),
    }
    predictor = predictor_of(policy)
    if predictor is not None:
        row["predictor"] = predictor  # VTC's output-length predictor
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print_table(f"replay {args.trace} on {args.gpu} + {args.model}", [row])
        if predictor is not None:
            print(f"  output-length predictor (VTC's predict): {predictor}")
        print(
            f"  simulated {result.t_end_s:.1f} s in {result.wall_s:.2f} s "
            f"({len(requests)} requests, KV pool {result.kv_capacity_tokens} tokens)"
        )
    return 0


# ---------------------------------------------------------------- helpers


def _user_value(fn, *args):
    """Call ``fn``; a ValueError is the user's mistake and becomes a one-line UsageError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _parse_policy_opts(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--policy-opt expects KEY=VALUE (got {item!r})")
        options[key.replace("-", "_")] = _coerce(raw)
    return options


def _coerce(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        if args.command == "list":
            return cmd_list()
        if args.command == "run":
            return cmd_run(args)
        return cmd_replay(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``... | head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
