"""The command line: flags to a ``LoadTestConfig`` (one-line errors, not argparse's usage
dump), the run under a progress bar, the table or the JSON on stdout, and the exit status."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .config import FRONTEND, NATIVE, PROG, LoadTestConfig, LoadTestError
from .output import print_fairness, progress_bar
from .run import run_loadtest

EXIT_USAGE = 2
EXIT_NO_SUCCESS = 1
SCENARIO_CHOICES = ("s1", "s2", "none")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise LoadTestError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Load-test an SGLang-compatible server for fairness.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--workload", required=True, help="tot | judge | longqa | chat | mixed")
    p.add_argument("--scenario", required=True, help="s1 | s2 | none")
    p.add_argument(
        "--clients", required=True, help="number of clients, or their names: alice,bob,..."
    )
    p.add_argument("--duration", type=float, required=True, help="seconds of program arrivals")
    p.add_argument("--rate", type=float, default=None, help="programs/s per normal client")
    p.add_argument("--rate-scale", type=float, default=None, help="× the base rate (default 1)")
    p.add_argument("--dp", type=int, default=None, help="default: the server's dp_size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key-file", type=Path, default=None, help="TOML/JSON: client = key")
    p.add_argument("--out", type=Path, default=None, help="default runs/loadtest-<timestamp>")
    p.add_argument("--json", action="store_true", help="print the results JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="program parameter for every client, e.g. document_len=2000",
    )
    p.add_argument("--drain-timeout", type=float, default=None, help="default max(30, duration)")
    p.add_argument("--call-timeout", type=float, default=600.0, help="per call, seconds")
    p.add_argument(
        "--stream-interval", type=int, default=None, help="ask for a chunk every N tokens"
    )
    p.add_argument(
        "--driver",
        default=NATIVE,
        help=f"{NATIVE} (token-level programs) | {FRONTEND} (SGLang frontend tot/judge)",
    )
    return p


def _parse_clients(value: str) -> tuple[int, tuple[str, ...] | None]:
    """``--clients``: a count, or comma-separated names (their count, the names)."""
    value = value.strip()
    if value.lstrip("-").isdigit():
        return int(value), None
    names = tuple(n.strip() for n in value.split(","))
    if not all(names):
        raise LoadTestError(f"--clients: a number or names separated by commas (got {value!r})")
    return len(names), names


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise LoadTestError(f"--param expects KEY=VALUE (got {item!r})")
        for cast in (int, float):
            try:
                params[key.replace("-", "_")] = cast(raw)
                break
            except ValueError:
                continue
        else:
            raise LoadTestError(f"--param {key}: value must be a number (got {raw!r})")
    return params


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    if args.scenario not in SCENARIO_CHOICES:
        raise LoadTestError(f"--scenario must be s1, s2 or none (got {args.scenario!r})")
    if args.api_key_file is not None and not args.api_key_file.is_file():
        raise LoadTestError(f"--api-key-file: no such file: {args.api_key_file}")
    num_clients, names = _parse_clients(args.clients)
    return LoadTestConfig(
        url=args.url,
        workload=args.workload,
        scenario=None if args.scenario == "none" else args.scenario,
        clients=num_clients,
        client_names=names,
        duration_s=args.duration,
        rate=args.rate,
        rate_scale=args.rate_scale,
        dp=args.dp,
        seed=args.seed,
        api_key_file=args.api_key_file,
        out=args.out,
        params=_parse_params(args.param),
        drain_timeout_s=args.drain_timeout,
        call_timeout_s=args.call_timeout,
        stream_interval=args.stream_interval,
        driver=args.driver,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        config = config_from_args(args)
        if config.driver == FRONTEND:  # failed calls are reported; not each traceback too
            warnings.filterwarnings("ignore", message="Error in stream_executor")
        show = not args.no_progress and not args.json and sys.stderr.isatty()
        t0 = time.monotonic()
        with progress_bar(show) as update:
            results = run_loadtest(config, on_update=update)
        if args.json:
            print(json.dumps(results, indent=2, default=str))
        else:
            print_fairness(results)
            took = time.monotonic() - t0
            print(f"report: {results['paths']['report']}  (run took {took:.0f} s)")
        totals = results["totals"]
        if totals["calls_ok"] == 0:
            first = next(iter(results["errors"]), None)
            why = f"; first error: {first}" if first else " (no program started)"
            print(f"{PROG}: no call succeeded{why}", file=sys.stderr)
            return EXIT_NO_SUCCESS
        return 0
    except LoadTestError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
