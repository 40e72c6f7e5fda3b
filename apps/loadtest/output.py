"""What a load test shows and leaves behind: the fairness table (stdout via rich, and
``report.md``), the totals and warnings under it, the progress bar on stderr, and the files
in ``--out`` (``requests.jsonl``, ``results.json``, ``report.md``, ``timeline.png``)."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sgl_fair.records import QUEUED_S

from .config import FRONTEND, NATIVE


def output_paths(out: Path) -> dict[str, Path]:
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
    paths = output_paths(out)
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
    lines = [
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
    if row.get("calls_throttled"):  # FairServe's OIT refused new interactions (429)
        lines.append(
            f"throttled: {row['interactions_throttled']} interactions of "
            f"{row['users_throttled']} users ({row['abusive_users_throttled']} misbehaving, "
            f"{row['benign_users_throttled']} well-behaved), {row['tokens_wasted']} tokens "
            "wasted on them; "
            f"users served {_f(row['users_served_pct'], '{:.1f}')} %"
        )
    if row.get("queue_delay_p50_s") is not None:  # the server reported meta_info.queue_time
        lines.append(
            f"waiting-queue delay P50 / P99: {_f(row['queue_delay_p50_s'], '{:.3f}')} / "
            f"{_f(row['queue_delay_p99_s'], '{:.3f}')} s; users with a call queued over "
            f"{QUEUED_S:g} s: {_f(row['users_queued_pct'], '{:.1f}')} %"
        )
    return lines


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


@contextlib.contextmanager
def progress_bar(enabled: bool):
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
