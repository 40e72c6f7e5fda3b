"""Result tables: the summary row's columns, value formatting and Markdown tables.

Shared by the experiments' reports (``sgl_fair.experiment.report``), the cluster reports and
the live load test, so every table formats a number the same way.
"""

from __future__ import annotations

from typing import Any

ROW_COLUMNS = (
    ("policy", "policy", "{}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("throughput_req_s", "req/s", "{:.2f}"),
    ("jain", "Jain", "{:.3f}"),
    ("service_diff_max", "diff max", "{:.0f}"),
    ("service_diff_avg", "diff avg", "{:.0f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("cache_hit_rate", "cache hit", "{:.2f}"),
)


PER_CLIENT_HEADER = ["policy", "client", "service", "rate/s", "TTFT p50", "TTFT p99", "done", "rej"]


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    try:
        return spec.format(value)
    except (TypeError, ValueError):
        return str(value)


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = [title for _, title, _ in ROW_COLUMNS]
    body = [[fmt(row.get(key), spec) for key, _, spec in ROW_COLUMNS] for row in rows]
    return header, body


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)
