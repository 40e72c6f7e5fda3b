"""Stored results: one JSON file per run, with the date, commit and machine it ran on.

Every experiment (``experiment run NAME --results PATH``) and bench that takes
``--results PATH`` writes the same envelope: the run's own JSON (an experiment's
``results.json`` keys, a bench's result dict) at the top level, plus

* ``schema``: ``"sgl-fair/results/1"`` — files without it are the older raw rows (a bench's
  ``--json`` output as it was) that ``bench/report.py`` reads too;
* ``kind``: ``"experiment"`` or ``"bench"``; ``name``: the experiment or bench;
* ``provenance``: ``date`` (YYYY-MM-DD, UTC), ``commit`` (short hash of HEAD), ``dirty``
  (tracked files differed from HEAD when it ran), ``machine`` (CPU model, cores, Python) and
  ``command`` (the argv).

``bench/report.py`` turns the headline figures of these files into the current-figures
table of BENCHMARKS.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "sgl-fair/results/1"
KINDS = ("experiment", "bench")
REPO = Path(__file__).resolve().parents[2]  # apps/experiment/stored.py -> the checkout


def machine() -> dict[str, Any]:
    """CPU model (``/proc/cpuinfo``'s first ``model name``), cores and Python version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(date: str | None = None, command: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and when a run happened; ``date`` overrides today's (UTC) date."""
    if date is not None:
        dt.date.fromisoformat(date)  # a ValueError names a bad date
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": date or dt.datetime.now(dt.timezone.utc).date().isoformat(),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "machine": machine(),
        "command": list(sys.argv if command is None else command),
    }


def envelope(
    kind: str,
    name: str,
    data: Mapping[str, Any],
    *,
    date: str | None = None,
    command=None,
    started: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``data`` (the run's own JSON object) inside the stored-results envelope;
    ``started``: the ``provenance()`` taken when the run began (a long run's checkout may
    move on before it ends), else taken now."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)} (got {kind!r})")
    reserved = {"schema", "kind", "name", "provenance"} & set(data)
    if reserved:
        raise ValueError(f"the run's JSON already has {', '.join(sorted(reserved))}")
    head = {"schema": SCHEMA, "kind": kind, "name": name}
    head["provenance"] = dict(started) if started is not None else provenance(date, command)
    return {**head, **data}


def results_path(target: Path, name: str, date: str, quick: bool = False) -> Path:
    """``target`` itself when it names a ``.json`` file, else ``target/NAME[-quick]-DATE.json``."""
    if target.suffix == ".json":
        return target
    return target / f"{name}{'-quick' if quick else ''}-{date}.json"


def write(
    target: Path,
    kind: str,
    name: str,
    data: Mapping[str, Any],
    *,
    quick: bool = False,
    date: str | None = None,
    command=None,
    started: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``data`` in the envelope to ``target`` (a file, or a folder: named by
    ``results_path``); returns the path written."""
    doc = envelope(kind, name, data, date=date, command=command, started=started)
    path = results_path(Path(target), name, doc["provenance"]["date"], quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def read(path: Path) -> Any:
    """A stored file (either shape) as JSON."""
    return json.loads(Path(path).read_text())
