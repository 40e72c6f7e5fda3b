"""``python -m sgl_fair.loadtest`` — drive a live SGLang-compatible server with a workload.

    python -m sgl_fair.loadtest --url URL --workload tot|judge|longqa|chat|mixed
        --scenario s1|s2|none --clients N|NAME,NAME,... --duration S [--rate R]
        [--rate-scale X] [--dp D] [--seed N] [--api-key-file F] [--out DIR] [--json]
        [--no-progress] [--param KEY=VALUE ...] [--drain-timeout S] [--call-timeout S]
        [--stream-interval N] [--driver native|sglang-frontend]

The same programs the simulated experiments run (``workloads.programs``), sent closed-loop
by ``workloads.harness`` to ``URL/generate``; the run is measured by the same code as the
simulated rows, so a live ``results.json`` row compares field by field with a simulated one.

``--clients`` is a number (clients ``c0, c1, …``) or their names (``alice,bob``: the first
is ``c0``, the scenario's misbehaver). ``--driver sglang-frontend`` runs the SGLang frontend
programs instead (``workloads.programs.sgl_frontend``: ``tot`` and ``judge`` written with
``@sgl.function``, through ``RuntimeEndpoint``; needs sglang installed), at the same arrival
times, measured by the same code; ``--param`` then sets their parameters (``branches``,
``depth``, ``num_candidates``, ``max_tokens``, ``context_words``, ``given_answers``).

Rates: by default each client sends ``BASE_RATE_PER_S[kind] × dp × rate_scale`` programs
per second, ``dp`` being the server's ``dp_size`` (from ``GET /server_info``) unless given;
``--rate R`` sets a normal client's rate outright (the scenario's misbehaver still sends
its multiple of it). ``--param`` overrides a program parameter for every client (e.g.
``--param document_len=2000`` for a model with a short context).

Prints the fairness table (``--json``: the results JSON) and writes to ``--out`` (default
``runs/loadtest-<timestamp>``): ``requests.jsonl`` (every call as observed),
``results.json`` (the row, the per-client table, the run's metadata), ``report.md`` and
``timeline.png``. Exit status: 0 for a completed run (failed calls are reported, not
fatal), 1 if no call succeeded, 2 for bad input or an unreachable server (one line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

EXIT_USAGE = 2
EXIT_NO_SUCCESS = 1
PROG = "python -m sgl_fair.loadtest"
SCENARIO_CHOICES = ("s1", "s2", "none")
NATIVE, FRONTEND = "native", "sglang-frontend"
DRIVERS = (NATIVE, FRONTEND)


class LoadTestError(ValueError):
    """A user mistake or an unusable endpoint: one line, exit status 2."""


@dataclass(frozen=True)
class LoadTestConfig:
    """One load test. Field names follow the CLI flags (errors name the flag).

    ``scenario``: ``"s1"``, ``"s2"`` or ``None`` (``"none"`` is accepted too). ``rate``
    overrides ``BASE_RATE_PER_S × dp × rate_scale`` (giving both is an error). ``dp``
    ``None``: the server's ``dp_size``, else 1. ``api_keys`` (client → key) or
    ``api_key_file`` (TOML or JSON of the same), not both. ``out`` ``None``:
    ``runs/loadtest-<timestamp>``; ``write`` False writes nothing (the results still say
    what would have been written where). ``client_names``: the clients' ids in order
    (default ``c0``, ``c1``, …). ``driver``: ``"native"`` (token-level programs over aiohttp)
    or ``"sglang-frontend"`` (the frontend programs, ``tot``/``judge`` only; ``params`` are
    theirs).
    """

    url: str
    workload: str
    scenario: str | None
    clients: int
    duration_s: float
    rate: float | None = None
    rate_scale: float | None = None
    dp: int | None = None
    seed: int = 0
    api_keys: Mapping[str, str] | None = None
    api_key_file: Path | None = None
    out: Path | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    drain_timeout_s: float | None = None
    call_timeout_s: float = 600.0
    health_timeout_s: float = 5.0
    stream_interval: int | None = None
    run_tag: str = ""
    write: bool = True
    client_names: tuple[str, ...] | None = None
    driver: str = NATIVE


# ---------------------------------------------------------------- validation


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def validate(config: LoadTestConfig) -> LoadTestConfig:
    """Check every field; returns the config with ``scenario="none"`` mapped to None."""
    from sgl_fair.workloads.programs import WORKLOADS

    c = config
    if not isinstance(c.url, str) or not c.url.startswith(("http://", "https://")):
        raise LoadTestError(f"--url must be an http:// or https:// URL (got {c.url!r})")
    if c.workload not in WORKLOADS:
        raise LoadTestError(f"--workload: unknown {c.workload!r} (known: {', '.join(WORKLOADS)})")
    scenario = None if c.scenario in (None, "none") else c.scenario
    if scenario not in (None, "s1", "s2"):
        raise LoadTestError(f"--scenario must be s1, s2 or none (got {c.scenario!r})")
    if c.workload == "chat" and scenario is not None:
        raise LoadTestError(
            "--scenario: workload chat is the Fig. 8 flood (c2, c3 misbehave) and takes none"
        )
    if c.workload == "chat":
        min_clients, why = 4, " for workload chat (c2 and c3 flood)"
    elif scenario is not None:
        min_clients, why = 2, f" with scenario {scenario} (c0 misbehaves, the others do not)"
    else:
        min_clients, why = 1, ""
    if not _is_int(c.clients) or c.clients < min_clients:
        raise LoadTestError(f"--clients must be >= {min_clients}{why} (got {c.clients!r})")
    if c.client_names is not None:
        names = tuple(c.client_names)
        if len(names) != c.clients or len(set(names)) != len(names):
            raise LoadTestError(f"--clients: {c.clients} distinct names needed (got {names!r})")
        from sgl_fair.config import BadClientId, validate_client_id

        for name in names:
            try:
                validate_client_id(name, "--clients")
            except BadClientId as e:
                raise LoadTestError(str(e)) from None
    if c.driver not in DRIVERS:
        raise LoadTestError(f"--driver must be one of {', '.join(DRIVERS)} (got {c.driver!r})")
    if c.driver == FRONTEND and c.workload not in ("tot", "judge"):
        raise LoadTestError(f"--driver {FRONTEND} runs workload tot or judge (got {c.workload})")
    if not _is_num(c.duration_s) or c.duration_s <= 0:
        raise LoadTestError(f"--duration must be a number > 0 seconds (got {c.duration_s!r})")
    if c.rate is not None and (not _is_num(c.rate) or c.rate <= 0):
        raise LoadTestError(f"--rate must be > 0 programs/s per client (got {c.rate!r})")
    if c.rate_scale is not None and (not _is_num(c.rate_scale) or c.rate_scale <= 0):
        raise LoadTestError(f"--rate-scale must be > 0 (got {c.rate_scale!r})")
    if c.rate is not None and c.rate_scale is not None:
        raise LoadTestError("--rate and --rate-scale: give one (--rate sets the rate outright)")
    if c.dp is not None and (not _is_int(c.dp) or c.dp < 1):
        raise LoadTestError(f"--dp must be an integer >= 1 (got {c.dp!r})")
    if not _is_int(c.seed) or c.seed < 0:
        raise LoadTestError(f"--seed must be an integer >= 0 (got {c.seed!r})")
    if c.drain_timeout_s is not None and (not _is_num(c.drain_timeout_s) or c.drain_timeout_s < 0):
        raise LoadTestError(f"--drain-timeout must be >= 0 seconds (got {c.drain_timeout_s!r})")
    if not _is_num(c.call_timeout_s) or c.call_timeout_s <= 0:
        raise LoadTestError(f"--call-timeout must be > 0 seconds (got {c.call_timeout_s!r})")
    si = c.stream_interval
    if si is not None and (not _is_int(si) or si < 1):
        raise LoadTestError(f"--stream-interval must be an integer >= 1 (got {si!r})")
    if c.api_keys is not None and c.api_key_file is not None:
        raise LoadTestError("--api-key-file: give api_keys or api_key_file, not both")
    return config if scenario == c.scenario else replace(config, scenario=scenario)


def load_api_keys(path: Path) -> dict[str, str]:
    """Client id → API key from a JSON object or a TOML table (``c0 = "sk-..."``)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise LoadTestError(f"--api-key-file: cannot read {path}: {e.strerror or e}") from None
    data: Any = None
    if path.suffix.lower() != ".toml":
        with contextlib.suppress(ValueError):
            data = json.loads(text)
    if data is None:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise LoadTestError(f"--api-key-file: {path} is not JSON (TOML needs 3.11+)") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise LoadTestError(f"--api-key-file: {path} is neither JSON nor TOML: {e}") from None
    if not isinstance(data, dict):
        raise LoadTestError(f"--api-key-file: {path} must map client ids to keys")
    for client, key in data.items():
        if not isinstance(key, str) or not key:
            raise LoadTestError(
                f"--api-key-file: the key of client {client!r} must be a non-empty string"
            )
    return dict(data)


# ---------------------------------------------------------------- the run


def _raise_fd_limit() -> None:
    """Every in-flight call holds a socket; a ToT S1 run can hold thousands."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def run_loadtest(
    config: LoadTestConfig,
    *,
    on_update: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Run the load test; return the results (what ``results.json`` holds, plus ``paths``).

    Raises ``LoadTestError`` for bad input, an unreachable server, or a client without an API
    key. ``on_update`` gets ``harness.HarnessStats`` snapshots during the run.
    """
    from sgl_fair.workloads.harness import HarnessConfig, fairness_table
    from sgl_fair.workloads.harness import harness_row as make_row
    from sgl_fair.workloads.programs import generate_programs

    config = validate(config)
    keys = dict(config.api_keys or {})
    if config.api_key_file is not None:
        keys = load_api_keys(config.api_key_file)
    _raise_fd_limit()
    harness_config = HarnessConfig(
        url=config.url,
        duration_s=float(config.duration_s),
        drain_timeout_s=config.drain_timeout_s,
        call_timeout_s=float(config.call_timeout_s),
        api_keys=keys,
        run_tag=config.run_tag,
        stream_interval=config.stream_interval,
    )
    # Everything that can be wrong with the flags is found before the server is contacted.
    clients = _clients(config, dp=config.dp or 1)
    if config.driver == FRONTEND:
        _frontend_programs(config, clients)
    missing = [c.client for c in clients if keys and c.client not in keys]
    if missing:
        raise LoadTestError(
            f"--api-key-file: no API key for client {missing[0]!r} "
            f"(clients: {', '.join(c.client for c in clients)})"
        )
    prepared: dict[str, Any] = {}

    def prepare(server_info: dict[str, Any]) -> list:
        """Between the probe and the run: the clients at the server's dp, their programs."""
        from sgl_fair.workloads.harness import server_dp_size

        server_dp = server_dp_size(server_info)
        if config.dp is not None:
            dp, source = config.dp, "flag"
        else:
            dp, source = server_dp or 1, "server" if server_dp else "default"
        clients = _clients(config, dp=dp)
        prepared.update(dp=dp, dp_source=source, clients=clients, server_info=server_info)
        if config.driver == FRONTEND:
            from sgl_fair.workloads.programs.sgl_driver import frontend_runs

            prepared["frontend_programs"] = _frontend_programs(config, clients)
            return frontend_runs(clients, float(config.duration_s), seed=config.seed)
        return generate_programs(clients, float(config.duration_s), seed=config.seed)

    result = asyncio.run(
        _probe_and_drive(config, harness_config, prepare, on_update, prepared=prepared)
    )
    clients = prepared["clients"]
    row = make_row(
        result,
        clients,
        workload_name=config.workload,
        scenario=config.scenario,
        dp=prepared["dp"],
        seed=config.seed,
        server_info=prepared["server_info"],
    )
    row.update(
        url=harness_config.url,
        num_clients=config.clients,
        rate=config.rate,
        rate_scale=config.rate_scale,
    )
    table = fairness_table(result, clients, use_ttft=config.workload == "longqa")
    results = {
        "row": row,
        "fairness": table,
        "totals": _totals(row, table, config.workload),
        "errors": dict(result.errors().most_common(20)),
        "run": _run_meta(config, harness_config, prepared, result),
    }
    out = config.out or Path("runs") / f"loadtest-{_stamp(result.started_at)}"
    results["paths"] = {k: str(p) for k, p in _paths(out).items()}
    if config.write:
        write_outputs(results, result, out)
    return results


def _clients(config: LoadTestConfig, *, dp: int) -> list:
    """The workload's clients (named as ``client_names`` says). The frontend driver's
    ``params`` are its programs' (checked by ``_frontend_programs``), not the token-level
    programs'."""
    from sgl_fair.workloads.harness import build_clients

    frontend = config.driver == FRONTEND
    try:
        clients = build_clients(
            config.workload,
            config.scenario,
            num_clients=config.clients,
            duration_s=float(config.duration_s),
            dp=dp,
            rate_scale=1.0 if config.rate_scale is None else float(config.rate_scale),
            rate=config.rate,
            params=None if frontend else config.params,
        )
    except ValueError as e:
        flag = "--param" if config.params else "--workload"
        raise LoadTestError(f"{flag}: {str(e).splitlines()[0]}") from None
    if config.client_names is not None:
        clients = [replace(c, client=n) for c, n in zip(clients, config.client_names, strict=True)]
    if frontend:  # what a misbehaver runs is its frontend program's (_frontend_programs)
        clients = [replace(c, params={}) for c in clients]
    return clients


def _frontend_programs(config: LoadTestConfig, clients: Sequence) -> dict[str, Any]:
    """Each client's frontend program (``--driver sglang-frontend``)."""
    try:
        from sgl_fair.workloads.programs.sgl_driver import frontend_programs
    except ImportError as e:
        raise LoadTestError(
            f"--driver {FRONTEND} needs sglang's frontend (pip install sglang): {e}"
        ) from None
    try:
        return frontend_programs(clients, config.scenario, config.params)
    except ValueError as e:
        raise LoadTestError(f"--param: {str(e).splitlines()[0]}") from None


async def _probe_and_drive(config, harness_config, prepare, on_update, *, prepared):
    import aiohttp

    from sgl_fair.workloads.harness import Unreachable, drive, probe_server

    async with aiohttp.ClientSession() as session:
        try:
            info = await probe_server(session, config.url, timeout_s=config.health_timeout_s)
        except Unreachable as e:
            raise LoadTestError(f"cannot reach URL: {e}") from None
    programs = prepare(info)
    loop = asyncio.get_running_loop()
    handled = []

    def on_start(stop: Callable[[], None]) -> None:
        # Ctrl-C stops the run cleanly (what ran is still reported); a second one kills it.
        if threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):

            def first_interrupt() -> None:
                loop.remove_signal_handler(signal.SIGINT)
                print(f"{PROG}: interrupted; stopping and reporting", file=sys.stderr)
                stop()

            loop.add_signal_handler(signal.SIGINT, first_interrupt)
            handled.append(signal.SIGINT)

    try:
        if config.driver == FRONTEND:
            return await _drive_frontend(
                programs, prepared["frontend_programs"], harness_config, on_update, on_start
            )
        return await drive(programs, harness_config, on_update=on_update, on_start=on_start)
    finally:
        for sig in handled:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


async def _drive_frontend(runs, programs, harness_config, on_update, on_start):
    """The frontend driver is synchronous (threads): it runs on an executor thread while
    this loop keeps Ctrl-C (``on_start``'s handler) working."""
    from sgl_fair.workloads.programs.sgl_driver import FrontendDriver
    from sgl_fair.workloads.programs.sgl_endpoint import FrontendCallError

    loop = asyncio.get_running_loop()
    try:
        driver = await loop.run_in_executor(
            None, lambda: FrontendDriver(runs, programs, harness_config)
        )
    except FrontendCallError as e:
        raise LoadTestError(f"cannot reach URL: {e}") from None
    on_start(driver.stop)
    return await loop.run_in_executor(None, driver.run, on_update)


def _stamp(unix: float) -> str:
    return datetime.fromtimestamp(unix).strftime("%Y%m%d-%H%M%S")


def _totals(row: Mapping[str, Any], table: Sequence[Mapping[str, Any]], workload: str) -> dict:
    return {
        "programs_started": row["num_programs_started"],
        "programs_done": row["num_programs_done"],
        "programs_failed": row["num_programs_failed"],
        "calls_ok": sum(r["calls_ok"] for r in table),
        "calls_failed": row["failed_calls"],
        "calls_unfinished": row["unfinished_calls"],
        "calls_unsent": row["unsent_calls"],
        "input_tokens": sum(r["input_tokens"] for r in table),
        "output_tokens": sum(r["output_tokens"] for r in table),
        "throughput_programs_s": row["throughput_programs_s"],
        "throughput_tok_s": row["throughput_tok_s"],
        "jain": row["jain"],
        "jain_scope": row["jain_scope"],
        "jain_actual": row["jain_actual"],
        "p50_well_behaved_s": row["p50_well_behaved_s"],
        "p99_well_behaved_s": row["p99_well_behaved_s"],
        "well_behaved_metric": "ttft" if workload == "longqa" else "program",
        "makespan_s": row["makespan_s"],
    }


def _run_meta(config, harness_config, prepared, result) -> dict[str, Any]:
    from sgl_fair import __version__

    return {
        "url": harness_config.url,
        "server_info": prepared["server_info"],
        "workload": config.workload,
        "scenario": config.scenario,
        "driver": config.driver,
        "frontend_programs": {c: repr(p) for c, p in prepared.get("frontend_programs", {}).items()},
        "clients": [
            {
                "client": c.client,
                "kind": c.kind,
                "well_behaved": c.well_behaved,
                "arrivals": repr(c.arrivals),
                "params": {k: repr(v) for k, v in c.params.items()},
            }
            for c in prepared["clients"]
        ],
        "flags": {
            "clients": config.clients,
            "duration_s": config.duration_s,
            "rate": config.rate,
            "rate_scale": config.rate_scale,
            "dp": config.dp,
            "seed": config.seed,
            "params": {k: repr(v) for k, v in dict(config.params).items()},
            "drain_timeout_s": config.drain_timeout_s,
            "call_timeout_s": config.call_timeout_s,
            "stream_interval": config.stream_interval,
            "api_key_file": str(config.api_key_file) if config.api_key_file else None,
        },
        "dp": prepared["dp"],
        "dp_source": prepared["dp_source"],
        "api_keys_for": sorted(harness_config.api_keys),  # which clients, never the keys
        "run_tag": harness_config.run_tag,
        "start_time": datetime.fromtimestamp(result.started_at, timezone.utc).isoformat(),
        "start_unix": result.started_at,
        "drain_timeout_s": harness_config.drain_s,
        "stopped_by_user": result.stopped,
        "sgl_fair_version": __version__,
    }


# ---------------------------------------------------------------- outputs


def _paths(out: Path) -> dict[str, Path]:
    return {
        "requests": out / "requests.jsonl",
        "results": out / "results.json",
        "report": out / "report.md",
        "timeline": out / "timeline.png",
    }


def write_outputs(results: dict[str, Any], result, out: Path) -> dict[str, Path]:
    """``requests.jsonl``, ``results.json``, ``timeline.png`` and ``report.md`` in ``out``."""
    from sgl_fair.workloads.cluster_report import plot_timeline

    out.mkdir(parents=True, exist_ok=True)
    paths = _paths(out)
    with paths["requests"].open("w") as f:
        for call in result.calls:
            f.write(json.dumps(call.to_dict(), separators=(",", ":")) + "\n")
    paths["results"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    with warnings.catch_warnings():  # a run with no service has nothing to put in a legend
        warnings.simplefilter("ignore", UserWarning)
        plot_timeline([results["row"]], paths["timeline"])
    paths["report"].write_text(render_report(results))
    return paths


def _f(value: Any, spec: str) -> str:
    from sgl_fair.workloads.report import fmt

    return fmt(value, spec)


def fairness_rows(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The fairness table as header + string cells (stdout and report.md share it)."""
    table = results["fairness"]
    ttft = any("ttft_p50_s" in r for r in table)
    header = ["client", "role", "programs done/started", "calls ok/failed", "input tok"]
    header += ["output tok", "service", "share", "program p50 s", "program p99 s"]
    if ttft:
        header += ["TTFT p50 s", "TTFT p99 s"]
    body = []
    for r in table:
        cells = [
            r["client"],
            r["role"],
            f"{r['programs_done']}/{r['programs_started']}",
            f"{r['calls_ok']}/{r['calls_failed']}",
            str(r["input_tokens"]),
            str(r["output_tokens"]),
            _f(r["service"], "{:.0f}"),
            _f(r["share"], "{:.1%}"),
            _f(r["program_p50_s"], "{:.2f}"),
            _f(r["program_p99_s"], "{:.2f}"),
        ]
        if ttft:
            cells += [_f(r.get("ttft_p50_s"), "{:.2f}"), _f(r.get("ttft_p99_s"), "{:.2f}")]
        body.append(cells)
    return header, body


LOOP_LAG_WARN_S = 0.1


def warnings_of(results: Mapping[str, Any]) -> list[str]:
    """What makes the numbers less trustworthy, in words."""
    row, out = results["row"], []
    frontend = results.get("run", {}).get("driver") == FRONTEND
    if row.get("max_loop_lag_s", 0.0) > LOOP_LAG_WARN_S and frontend:
        out.append(
            f"the load generator started programs up to {row['max_loop_lag_s']:.2f} s late "
            "(its threads were CPU-bound): program latencies include that; try a lower rate "
            "or fewer clients"
        )
    elif row.get("max_loop_lag_s", 0.0) > LOOP_LAG_WARN_S:
        out.append(
            f"the load generator was CPU-bound (its event loop ran up to "
            f"{row['max_loop_lag_s']:.2f} s late): recorded times are late by up to that; "
            "try a larger --stream-interval (fewer SSE chunks), a lower rate or fewer clients"
        )
    if row.get("unfinished_calls") or row.get("unsent_calls"):
        out.append(
            f"{row['unfinished_calls']} calls were still running and {row['unsent_calls']} "
            "waiting at the drain cut-off (--drain-timeout); their programs count with their "
            "age then"
        )
    if row.get("stopped"):
        out.append("the run was interrupted (Ctrl-C): it covers less than --duration")
    return out


def totals_lines(results: Mapping[str, Any]) -> list[str]:
    t = results["totals"]
    row = results["row"]
    metric = "TTFT of their calls" if t["well_behaved_metric"] == "ttft" else "program latency"
    scope = (
        f"all-active interval [{_f(row['active_t0_s'], '{:.1f}')}, "
        f"{_f(row['active_t1_s'], '{:.1f}')}] s"
        if t["jain_scope"] == "active"
        else "whole run (no interval with every client active)"
    )
    return [
        f"throughput: {_f(t['throughput_programs_s'], '{:.3f}')} programs/s, "
        f"{_f(t['throughput_tok_s'], '{:.0f}')} tokens/s "
        f"(over {_f(t['makespan_s'], '{:.1f}')} s)",
        f"Jain's index (client-perceived service, {scope}): {_f(t['jain'], '{:.3f}')}; "
        f"on the GPU's actual work: {_f(t['jain_actual'], '{:.3f}')}",
        f"well-behaved P50 / P99 ({metric}, mean over clients): "
        f"{_f(t['p50_well_behaved_s'], '{:.2f}')} / {_f(t['p99_well_behaved_s'], '{:.2f}')} s",
        f"programs: {t['programs_done']} done, {t['programs_failed']} failed, "
        f"{t['programs_started']} started; calls: {t['calls_ok']} ok, {t['calls_failed']} "
        f"failed, {t['calls_unfinished']} unfinished, {t['calls_unsent']} unsent at the cut-off",
    ]


def render_report(results: Mapping[str, Any]) -> str:
    from sgl_fair.workloads.report import markdown_table

    run, row = results["run"], results["row"]
    header, body = fairness_rows(results)
    rate = (
        f"{row['rate']:g} programs/s per client (misbehaver multipliers on top)"
        if row.get("rate") is not None
        else f"BASE_RATE_PER_S[kind] × dp {row['dp']} × rate-scale {row.get('rate_scale') or 1:g}"
    )
    errors = "\n".join(f"- {n} × {msg}" for msg, n in results["errors"].items()) or "- none"
    cautions = "".join(f"\n- **warning:** {w}" for w in warnings_of(results))
    totals = "\n".join(f"- {line}" for line in totals_lines(results))
    model = f", model {row['model']}" if row.get("model") else ""
    frontend = ""
    if run.get("driver") == FRONTEND:
        frontend = (
            " (SGLang frontend programs: "
            + ", ".join(f"{c} {p}" for c, p in run["frontend_programs"].items())
            + ")"
        )
    return f"""# Load test — {run["workload"]} {run["scenario"] or ""} against {run["url"]}

- started {run["start_time"]}; arrivals for {row["duration_s"]:g} s, then up to
  {run["drain_timeout_s"]:g} s of drain; the run took {row["makespan_s"]:.1f} s
- {row["num_clients"]} clients at {rate}; dp {row["dp"]} ({run["dp_source"]}); seed {row["seed"]}
- server policy {row["policy"]}{model}; driver {run.get("driver", NATIVE)}{frontend}

## Fairness

{markdown_table(header, body)}

{totals}
- cache hit rate (cached / prompt tokens, as the server reported): {row["cache_hit_rate"]:.2f}
- load generator: sent up to {row["max_send_lag_s"]:.3f} s behind schedule; its event loop
  ran up to {row["max_loop_lag_s"]:.3f} s late{cautions}

## Failed calls

{errors}

## Notes

- Service is client-perceived: input + 2 × output tokens of what was served (input counted
  when the first token arrived, output as it streamed); "share" is of all service in the
  run, Jain's index is over the clients' service *rates* in the interval in which every
  client was sending, as in the simulated experiments.
- Program latency runs from a program's scheduled start to its last call's finish; a
  program cut off by the drain timeout counts with its age then (a lower bound). Failed
  calls are counted and stop their program.
- `requests.jsonl` has every call as observed (send, first token, each chunk, finish,
  tokens, cached tokens, status, error); `results.json` the row with the cluster
  experiments' fields.

## Plots

![timeline](timeline.png)
"""


# ---------------------------------------------------------------- CLI


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


@contextlib.contextmanager
def _progress_bar(enabled: bool):
    """A rich progress bar on stderr (stdout stays the table or the JSON)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    task = progress.add_task("issuing", total=None, info="")

    def update(s) -> None:
        phase = "draining" if s.draining else f"issuing {s.elapsed_s:.0f}/{s.duration_s:g}s"
        progress.update(
            task,
            description=phase,
            total=max(s.programs_total, 1),
            completed=s.programs_done + s.programs_failed,
            info=(
                f"programs {s.programs_done}/{s.programs_started} done ({s.programs_failed} "
                f"failed) · calls {s.calls_ok} ok {s.calls_failed} failed "
                f"{s.calls_in_flight} live"
            ),
        )

    with progress:
        yield update


def print_fairness(results: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    run = results["run"]
    title = (
        f"load test: {run['workload']} {run['scenario'] or ''} · {run['url']} · "
        f"{results['row']['policy']} · dp {run['dp']}"
    )
    header, body = fairness_rows(results)
    table = Table()
    for i, col in enumerate(header):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=True)
    for r in body:
        table.add_row(*r)
    console = Console(width=max(180, len(title) + 4))
    console.print(title, highlight=False, markup=False)
    console.print(table)
    for line in totals_lines(results):
        console.print("  " + line, highlight=False, markup=False)
    for msg, n in list(results["errors"].items())[:5]:
        console.print(f"  failed: {n} × {msg}", highlight=False, markup=False)
    for w in warnings_of(results):
        console.print(f"  warning: {w}", highlight=False, markup=False)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        config = config_from_args(args)
        if config.driver == FRONTEND:  # failed calls are reported; not each traceback too
            warnings.filterwarnings("ignore", message="Error in stream_executor")
        show = not args.no_progress and not args.json and sys.stderr.isatty()
        t0 = time.monotonic()
        with _progress_bar(show) as update:
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
