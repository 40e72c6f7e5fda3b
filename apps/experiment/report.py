"""Experiment outputs: ``results.json``, ``report.md`` and the papers' style of plots.

Plots (matplotlib, headless):

* ``service_rate.png`` — per-client service rate over time, one panel per policy
  (VTC Fig. 3b/4b...: sliding windows of ``window_s``, stepped every few seconds);
* ``response_time.png`` — per-client mean TTFT of the served requests that arrived in
  each window; where most of a window's requests were never served the curve has a gap;
* ``service_diff.png`` — absolute difference of accumulated service between the
  two most-served clients (VTC Fig. 3a), all policies on one axis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from sgl_fair import metrics
from sgl_fair.workloads.report import PER_CLIENT_HEADER, fmt, markdown_table, table_rows

from .single import ExperimentResult, PolicyRun


def write_outputs(result: ExperimentResult, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": out_dir / "results.json",
        "report": out_dir / "report.md",
        "service_rate": out_dir / "service_rate.png",
        "response_time": out_dir / "response_time.png",
        "service_diff": out_dir / "service_diff.png",
    }
    data = result.to_json()
    paths["results"].write_text(json.dumps(data, indent=2) + "\n")
    plot_service_rate(result, paths["service_rate"])
    plot_response_time(result, paths["response_time"])
    plot_service_diff(result, paths["service_diff"])
    paths["report"].write_text(render_report(result, data))
    return paths


def render_report(result: ExperimentResult, data: dict[str, Any]) -> str:
    exp = result.experiment
    worker = data["worker"]
    header, body = table_rows(result.rows)
    per_client = []
    for run in result.runs.values():
        for client, c in run.row["clients"].items():
            per_client.append(
                [
                    run.spec.label,
                    client,
                    fmt(c["service"], "{:.0f}"),
                    fmt(c["service_rate"], "{:.1f}"),
                    fmt(c["ttft_p50_s"], "{:.2f}"),
                    fmt(c["ttft_p99_s"], "{:.2f}"),
                    str(c["num_finished"]),
                    str(c["num_rejected"]),
                ]
            )
    claims = "\n".join(
        f"- [{'x' if c.passed else ' '}] {c.text} — {c.detail}" for c in result.claims
    )
    mode = "quick" if result.quick else "full length"
    predictors = ", ".join(
        f"{run.spec.label}: `{run.row['predictor']}`"
        for run in result.runs.values()
        if "predictor" in run.row
    )
    if predictors:
        predictors = f" Output-length predictor (VTC's `predict`): {predictors}."
    return f"""# {exp.name} — {exp.figure}

{exp.description}

Simulated {worker["gpu"]} + {worker["model"]} (tp={worker["tp"]}), KV pool
{worker["kv_tokens"]} tokens, {result.duration_s:.0f} s of virtual time ({mode}), seed
{result.seed}; service = {exp.cost}; {exp.window_s:.0f} s windows.{predictors} Simulated in
{result.wall_s:.1f} s of wall time.

## Summary

{markdown_table(header, body)}

## Claims (the property the paper's figure shows)

{claims}

## Per client

{markdown_table(PER_CLIENT_HEADER, per_client)}

## Plots

![service rate](service_rate.png)

![response time](response_time.png)

![accumulated service difference](service_diff.png)
"""


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _step_s(result: ExperimentResult) -> float:
    return max(1.0, result.duration_s / 120)


def _policy_panels(
    result: ExperimentResult, path: Path, *, title: str, ylabel: str, series
) -> None:
    """One panel per policy; ``series(run, window_s, step_s)`` gives (times, {client: values})."""
    plt = _plt()
    runs = list(result.runs.values())
    window = min(result.experiment.window_s, result.duration_s / 8)
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        times, values = series(run, window, _step_s(result))
        for client in sorted(values):
            ax.plot(times, values[client], label=client)
        ax.set_title(f"{run.spec.label}: {title} ({window:.0f} s window)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_service_rate(result: ExperimentResult, path: Path) -> None:
    exp = result.experiment

    def series(run: PolicyRun, window_s: float, step_s: float):
        return metrics.service_rate_series(
            run.arrays, exp.cost, window_s=window_s, t_end=result.duration_s, step_s=step_s
        )

    _policy_panels(result, path, title="service rate", ylabel="service / s", series=series)


def response_time_series(
    run: PolicyRun, *, window_s: float, step_s: float, t_end: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Mean TTFT of the served requests that arrived in each sliding window.

    A window where fewer than half of the client's requests were served by the end of the
    run is left out (NaN: a gap in the curve) — its mean would describe only the lucky few.
    """
    ends = np.arange(window_s, t_end + 1e-9, step_s)
    out: dict[str, np.ndarray] = {}
    for client in sorted({r.client for r in run.records}):
        recs = sorted(
            (r for r in run.records if r.client == client and not r.rejected),
            key=lambda r: r.arrival_s,
        )
        arr = np.array([r.arrival_s for r in recs])
        served = np.array([r.ttft_s is not None for r in recs], dtype=float)
        ttft = np.array([r.ttft_s if r.ttft_s is not None else 0.0 for r in recs])
        csum_t = np.concatenate([[0.0], np.cumsum(ttft)])
        csum_n = np.concatenate([[0.0], np.cumsum(served)])
        lo = np.searchsorted(arr, ends - window_s, side="left")
        hi = np.searchsorted(arr, ends, side="left")
        total, n_served = hi - lo, csum_n[hi] - csum_n[lo]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (csum_t[hi] - csum_t[lo]) / n_served
        out[client] = np.where((total > 0) & (n_served >= 0.5 * total), mean, np.nan)
    return ends, out


def plot_response_time(result: ExperimentResult, path: Path) -> None:
    def series(run: PolicyRun, window_s: float, step_s: float):
        return response_time_series(run, window_s=window_s, step_s=step_s, t_end=result.duration_s)

    _policy_panels(result, path, title="response time (mean TTFT)", ylabel="seconds", series=series)


def plot_service_diff(result: ExperimentResult, path: Path) -> None:
    plt = _plt()
    exp = result.experiment
    fig, ax = plt.subplots(figsize=(8, 3.2))
    times = np.arange(0.0, result.duration_s + 1e-9, _step_s(result))
    for run in result.runs.values():
        acc = metrics.accumulated_service(run.arrays, exp.cost, times=times)
        top = sorted(acc, key=lambda c: -acc[c][-1])[:2]
        if len(top) < 2:
            continue
        ax.plot(times, np.abs(acc[top[0]] - acc[top[1]]), label=run.spec.label)
    ax.set_title("absolute difference of accumulated service (two most-served clients)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("service")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
