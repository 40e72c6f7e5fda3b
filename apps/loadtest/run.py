"""One load test from a validated config to its results: the clients at the server's dp,
their programs, the probe and the run (native or SGLang-frontend driver, Ctrl-C wired to a
clean stop), then the row, the fairness table and the run's metadata."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sgl_fair.launch.ports import raise_fd_limit

from .config import FRONTEND, PROG, LoadTestConfig, LoadTestError, load_api_keys, validate
from .output import output_paths, write_outputs


def run_loadtest(
    config: LoadTestConfig,
    *,
    on_update: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Run the load test; return the results (what ``results.json`` holds, plus ``paths``).

    Raises ``LoadTestError`` for bad input, an unreachable server, or a client without an API
    key. ``on_update`` gets ``harness.HarnessStats`` snapshots during the run.
    """
    from sgl_fair.workloads.harness import HarnessConfig
    from sgl_fair.workloads.harness_report import fairness_table
    from sgl_fair.workloads.harness_report import harness_row as make_row
    from sgl_fair.workloads.programs import generate_programs

    config = validate(config)
    keys = dict(config.api_keys or {})
    if config.api_key_file is not None:
        keys = load_api_keys(config.api_key_file)
    raise_fd_limit()
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
        from sgl_fair.workloads.harness_report import server_dp_size

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
    results["paths"] = {k: str(p) for k, p in output_paths(out).items()}
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

    from sgl_fair.workloads.harness import drive
    from sgl_fair.workloads.loadclient import Unreachable, probe_server

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
