"""Printing an experiment for a terminal: tables (rich) and claims, shared by every family."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sgl_fair.experiment.registry import Claim


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    from sgl_fair.workloads.report import table_rows

    header, body = table_rows(rows)
    print_rows(title, header, body)


def print_rows(title: str, header: list[str], body: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(header):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in body:
        table.add_row(*r)
    Console(width=max(120, len(title) + 4)).print(table)


def print_claims(claims: Iterable[Claim]) -> None:
    for c in claims:
        print(f"  [{'PASS' if c.passed else 'FAIL'}] {c.text} — {c.detail}")
