"""Outputs of cluster experiments: ``results.json``, ``report.md`` and the paper-style plots.

* ``grid.png`` — Fig. 7: per workload × scenario, throughput / Jain / well-behaved P99 against
  the number of GPUs, one line per router + local pairing;
* ``sweep.png`` — Figs. 1, 10, 11: throughput and Jain against the swept value (Q, Q_u,
  number of clients), baselines as horizontal lines or their own curves;
* ``pareto.png`` — Fig. 1: throughput against Jain, each point labelled with its value;
* ``timeline.png`` — Figs. 8, 9, 12: per policy, each call's response time at its finish,
  and per-client actual and client-perceived service rates over time.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .report import fmt, markdown_table

COLUMNS = (
    ("policy", "policy", "{}"),
    ("dp", "dp", "{}"),
    ("workload", "workload", "{}"),
    ("scenario", "scen.", "{}"),
    ("x", "x", "{:g}"),
    ("setup", "routers", "{}"),  # router replicas (d2lpm-replicas)
    ("replicas", "R", "{}"),
    ("report_period_s", "report s", "{:g}"),
    ("offered_tok_s", "offered tok/s", "{:.0f}"),
    ("served_tok_s", "served tok/s", "{:.0f}"),
    ("throughput_tok_s", "drained tok/s", "{:.0f}"),
    ("jain", "Jain", "{:.3f}"),
    ("jain_actual", "Jain act.", "{:.3f}"),
    ("p50_well_behaved_s", "WB p50 s", "{:.1f}"),
    ("p99_well_behaved_s", "WB p99 s", "{:.1f}"),
    ("cache_hit_rate", "cache hit", "{:.2f}"),
    ("misbehaver_share", "misb. share", "{:.3f}"),
    ("view_lag_max", "view lag", "{:.0f}"),
    ("makespan_s", "makespan s", "{:.0f}"),
)


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    header = [title for _, title, _ in cols]
    return header, [[fmt(r.get(k), spec) for k, _, spec in cols] for r in rows]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by(rows, *keys):
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r.get(k) for k in keys)].append(r)
    return groups


def plot_grid(rows: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    panels = sorted(_by(rows, "workload", "scenario"), key=str)
    metrics = (
        ("served_tok_s", "served while arriving (tok/s)", False),
        ("jain", "Jain's index", False),
        ("p99_well_behaved_s", "well-behaved P99 (s)", True),
    )
    fig, axes = plt.subplots(
        len(panels), 3, figsize=(13, 2.8 * len(panels)), squeeze=False, sharex=True
    )
    for i, key in enumerate(panels):
        sub = _by(rows, "workload", "scenario")[key]
        for j, (m, label, log) in enumerate(metrics):
            ax = axes[i, j]
            for pol, rs in _by(sub, "policy").items():
                rs = sorted((r for r in rs if r.get(m) is not None), key=lambda r: r["dp"])
                ax.plot([r["dp"] for r in rs], [r[m] for r in rs], marker="o", label=pol[0])
            ax.set_title(f"{key[0]} {key[1] or ''}: {label}", fontsize="small")
            if log:
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("GPUs (dp)")
    axes[0, 0].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _x(r: dict) -> float:
    x = r.get("x")
    return math.inf if x is None else float(x)


def plot_sweep(rows: list[dict[str, Any]], path: Path, *, x_label: str) -> None:
    plt = _plt()
    swept = [r for r in rows if r.get("x") is not None]
    fixed = [r for r in rows if r.get("x") is None]
    finite = [_x(r) for r in swept if math.isfinite(_x(r))]
    inf_at = max(finite) * 2 if finite else 1.0  # ∞ is drawn one step right of the largest
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, (m, label) in zip(
        axes, (("throughput_tok_s", "throughput (tok/s)"), ("jain", "Jain's index")), strict=True
    ):
        for pol, rs in _by(swept, "policy").items():
            rs = sorted(rs, key=_x)
            xs = [_x(r) if math.isfinite(_x(r)) else inf_at for r in rs]
            ax.plot(xs, [r.get(m) for r in rs], marker="o", label=pol[0])
        for k, r in enumerate(fixed):
            ax.axhline(r.get(m) or 0.0, ls="--", color=f"C{k + 5}", label=r["policy"])
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        if finite and max(finite) / max(min(finite), 1e-9) > 20:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_pareto(rows: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, (pol, rs) in enumerate(_by(rows, "policy").items()):
        rs = sorted(rs, key=_x)
        ax.plot([r["jain"] for r in rs], [r["throughput_tok_s"] for r in rs], "o-", color=f"C{k}")
        ax.annotate(pol[0], (rs[-1]["jain"], rs[-1]["throughput_tok_s"]), fontsize="x-small")
        for r in rs:
            if r.get("x") is not None:
                ax.annotate(f"{r['x']:g}", (r["jain"], r["throughput_tok_s"]), fontsize=6)
    ax.set_xlabel("Jain's fairness index")
    ax.set_ylabel("throughput (tok/s)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_timeline(rows: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    rows = [r for r in rows if "series" in r]
    if not rows:
        return
    fig, axes = plt.subplots(
        3, len(rows), figsize=(3.6 * len(rows), 8), squeeze=False, sharex="col"
    )
    for j, r in enumerate(rows):
        s = r["series"]
        clients = sorted(s["perceived"])
        for k, c in enumerate(clients):
            pts = s["response"].get(c, [])
            axes[0, j].scatter([p[0] for p in pts], [p[1] for p in pts], s=2, color=f"C{k}")
            axes[1, j].plot(s["t"], s["actual"].get(c, []), color=f"C{k}", label=c)
            axes[2, j].plot(s["t"], s["perceived"].get(c, []), color=f"C{k}", label=c)
        axes[0, j].set_title(r["policy"], fontsize="small")
        axes[2, j].set_xlabel("time (s)")
    axes[0, 0].set_ylabel("response time (s)")
    axes[1, 0].set_ylabel("actual service / s")
    axes[2, 0].set_ylabel("perceived service / s")
    axes[1, 0].legend(fontsize="x-small")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_cluster_outputs(result, out_dir: Path) -> dict[str, Path]:
    """Write results.json, report.md and the experiment's plots into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exp = result.experiment
    paths = {"results": out_dir / "results.json", "report": out_dir / "report.md"}
    data = result.to_json()
    paths["results"].write_text(json.dumps(data, indent=2) + "\n")
    rows = result.rows
    for kind in exp.plots:
        paths[kind] = out_dir / f"{kind}.png"
        if kind == "grid":
            plot_grid(rows, paths[kind])
        elif kind == "sweep":
            plot_sweep(rows, paths[kind], x_label=exp.x_label or "x")
        elif kind == "pareto":
            plot_pareto(rows, paths[kind])
        elif kind == "timeline":
            plot_timeline(rows, paths[kind])
    paths["report"].write_text(render_report(result, paths))
    return paths


def render_report(result, paths: dict[str, Path]) -> str:
    exp = result.experiment
    header, body = table(result.rows)
    claims = "\n".join(
        f"- [{'x' if c.passed else ' '}] {c.text} — {c.detail}" for c in result.claims
    )
    plots = "\n".join(
        f"![{k}]({p.name})" for k, p in paths.items() if k not in ("results", "report")
    )
    mode = "quick" if result.quick else "full length"
    first = result.rows[0] if result.rows else {}
    return f"""# {exp.name} — {exp.figure}

{exp.description}

Simulated {first.get("gpu")} + {first.get("model")} workers, {mode} ({result.num_runs} runs,
seed {result.seed}); service = input + 2 × output tokens (client-perceived; "Jain act." uses
extend + 2 × output, the GPU's actual work). Simulated in {result.wall_s:.1f} s of wall time.
WB = well-behaved clients (mean over them of each client's P50/P99 program latency; TTFT for
long-document QA).

## Summary

{markdown_table(header, body)}

## Claims (the property the paper's figure shows)

{claims}

## Plots

{plots}
"""
