"""``make bench-report``: the current-figures table of BENCHMARKS.md, from the stored results.

    python bench/report.py            # rewrite the table between the markers in BENCHMARKS.md
    python bench/report.py --check    # exit 1, naming the differences, if the table is stale
    python bench/report.py --print    # print the table only

Reads every file under ``bench/results/`` that a figure of ``bench/figures.py`` names (the
newest match of its glob), takes each figure's value and status from it, and writes one row
per figure — name, value, target, status, date, commit, source — between
``<!-- current-figures:begin -->`` and ``<!-- current-figures:end -->``, then one line per
source file with its machine. The output is a pure function of the stored files: the same
files give the same bytes. A figure whose file or value is missing is a row that says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from figures import FIGURES, README_QUOTES, STORED, Figure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"
README = ROOT / "README.md"
BEGIN = "<!-- current-figures:begin -->"
END = "<!-- current-figures:end -->"
SCHEMA = "sgl-fair/results/1"
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
_SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")


# ---------------------------------------------------------------- reading


def provenance(path: Path, data: Any) -> dict[str, str]:
    """date, commit and machine of a stored file: its envelope's, else ``STORED``'s entry, else
    the date in its name."""
    if isinstance(data, dict) and data.get("schema") == SCHEMA:
        p = data["provenance"]
        m = p.get("machine") or {}
        commit = str(p.get("commit") or "?") + (" (dirty)" if p.get("dirty") else "")
        machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, Python {m.get('python')}"
        return {"date": p["date"], "commit": commit, "machine": machine}
    known = STORED.get(path.name, {})
    found = _DATE.search(path.name)
    return {
        "date": known.get("date") or (found.group(1) if found else "?"),
        "commit": known.get("commit", "?"),
        "machine": known.get("machine", "?"),
    }


def newest(results: Path, pattern: str) -> tuple[Path, Any] | None:
    """The newest stored file matching ``pattern``, by its date and then its name."""
    found = []
    for path in sorted(results.glob(pattern)):
        data = json.loads(path.read_text())
        found.append((provenance(path, data)["date"], path.name, path, data))
    if not found:
        return None
    _, _, path, data = max(found, key=lambda f: (f[0], f[1]))
    return path, data


def _same(have: Any, want: str) -> bool:
    if isinstance(have, (int, float)) and not isinstance(have, bool):
        try:
            return float(want) == float(have)
        except ValueError:
            return False
    return str(have) == want


def lookup(data: Any, path: str) -> Any:
    """The value at ``path`` (``a.b[k=v].c``, ``rows[0]``); KeyError naming the missing step."""
    node = data
    for select, key in _SEGMENT.findall(path):
        if key:
            if not isinstance(node, dict) or key not in node:
                raise KeyError(f"{path}: no {key!r}")
            node = node[key]
        elif select.isdigit():
            node = node[int(select)]
        else:
            want = dict(part.split("=", 1) for part in select.split(","))
            hits = [
                e
                for e in node
                if isinstance(e, dict) and all(k in e and _same(e[k], v) for k, v in want.items())
            ]
            if len(hits) != 1:
                raise KeyError(f"{path}: [{select}] matches {len(hits)} elements, not 1")
            node = hits[0]
    return node


def value_of(fig: Figure, data: Any) -> float:
    if isinstance(fig.value, tuple):
        num, den = fig.value
        return lookup(data, num) / lookup(data, den)
    return lookup(data, fig.value)


def status_of(fig: Figure, value: float, data: Any) -> str:
    if fig.claim is not None:
        claims = [c for c in data.get("claims", []) if fig.claim in c["text"]]
        if len(claims) != 1:
            return f"no claim ({len(claims)} match)"
        return "pass" if claims[0]["passed"] else "**FAIL**"
    if fig.target is None:
        return "—"
    op, bound = fig.target
    met = value <= bound if op == "<=" else value >= bound
    return "pass" if met else "**missed**"


def _number(fig: Figure, value: float) -> str:
    text = fig.fmt.format(value)
    return f"{float(text):,.0f}" if fig.fmt == "{:.0f}" else text


def figures(results: Path = RESULTS) -> list[dict[str, str]]:
    """One row per figure: key, name, number, value (with unit), target, status, date,
    commit, source, machine."""
    rows = []
    for fig in FIGURES:
        row = {"key": fig.key, "name": fig.name, "target": _target(fig)}
        found = newest(results, fig.files)
        if found is None:
            rows.append({**row, "number": "—", "value": "—", "status": "no stored file",
                         "date": "—", "commit": "—", "source": f"(none: {fig.files})",
                         "machine": "—"})  # fmt: skip
            continue
        path, data = found
        prov = provenance(path, data)
        try:
            value = value_of(fig, data)
        except (KeyError, IndexError, TypeError, ZeroDivisionError) as e:
            number, text, status = "—", "—", f"no value: {e}"
        else:
            number = _number(fig, value)
            text, status = number + fig.unit, status_of(fig, value, data)
        rows.append({**row, "number": number, "value": text, "status": status, **prov,
                     "source": path.name})  # fmt: skip
    return rows


def _target(fig: Figure) -> str:
    if fig.target is not None:
        op, bound = fig.target
        return f"{'≤' if op == '<=' else '≥'} {bound:g}{fig.unit}"
    if fig.claim is not None:
        return "the run's claim: " + _claim_bound(fig.claim)
    return ""


def _claim_bound(claim: str) -> str:
    found = re.search(r"(>=|<=) ?([\d.]+x)", claim)
    if not found:
        return claim.removeprefix("paper: ").replace(">=", "≥").replace("<=", "≤")
    return f"{'≥' if found.group(1) == '>=' else '≤'} {found.group(2).replace('x', '×')}"


# ---------------------------------------------------------------- writing


def render(rows: list[dict[str, str]]) -> str:
    lines = [
        BEGIN,
        "## Current figures",
        "",
        "Generated by `make bench-report` (`bench/report.py`) from the stored results in",
        "`bench/results/`; the headline figures are declared in `bench/figures.py`. Do not edit",
        "by hand: `tests/apps/test_bench_report.py` fails when this table differs from the files.",
        "A figure whose run missed its target or failed its claim says so here.",
        "",
        "| figure | value | target | status | date | commit | source |",
        "|---|---:|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['value']} | {r['target']} | {r['status']} | {r['date']} "
            f"| {r['commit']} | `{r['source']}` |"
        )
    lines += ["", "Machines:"]
    for source, machine in sorted({(r["source"], r["machine"]) for r in rows if r["date"] != "—"}):
        lines.append(f"- `{source}`: {machine}")
    lines.append(END)
    return "\n".join(lines) + "\n"


def splice(doc: str, table: str) -> str:
    """``doc`` with the block between the markers replaced by ``table`` (which carries the
    markers); with no markers yet, inserted after the title line."""
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        return head + table + tail.removeprefix("\n")
    title, _, body = doc.partition("\n")
    return f"{title}\n\n{table}\n{body.lstrip(chr(10))}"


def quotes(rows: list[dict[str, str]]) -> list[str]:
    """``README_QUOTES`` with their figures filled in: ``{key}`` is the value with its unit,
    ``{key/n}`` the number alone."""
    values = {r["key"]: r["value"] for r in rows}
    values.update({f"{r['key']}/n": r["number"] for r in rows})
    return [words.format(**values) for words in README_QUOTES]


def readme_mismatches(readme: str, rows: list[dict[str, str]]) -> list[str]:
    """The README quotes that do not appear with the current values (whitespace and line
    breaks aside)."""
    text = " ".join(readme.split())
    return [f"README lacks {q!r}" for q in quotes(rows) if " ".join(q.split()) not in text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if BENCHMARKS.md or README drift")
    ap.add_argument("--print", action="store_true", help="print the table only")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--benchmarks", type=Path, default=BENCHMARKS)
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    rows = figures(args.results)
    table = render(rows)
    if args.print:
        print(table, end="")
        return 0
    doc = args.benchmarks.read_text()
    new = splice(doc, table)
    if args.check:
        problems = [] if new == doc else [f"{args.benchmarks}: the current-figures table is stale"]
        problems += readme_mismatches(args.readme.read_text(), rows)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run `make bench-report` (and fix the README's figures)", file=sys.stderr)
        return 1 if problems else 0
    if new != doc:
        args.benchmarks.write_text(new)
    print(f"{args.benchmarks}: {len(rows)} figures from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
