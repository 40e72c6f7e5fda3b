"""What the named cluster experiments are made of: the ``ClusterExperiment`` record, the
helpers their claims use, and the load the grid and the sweeps share (``RATE_SCALE``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgl_fair.experiment.single import Claim

from .cluster_runs import RunSpec


@dataclass(frozen=True)
class ClusterExperiment:
    name: str
    figure: str
    description: str
    build: Callable[[bool, int], list[RunSpec]]  # (quick, seed) -> runs
    claims: Callable[[list[dict[str, Any]]], list[Claim]]
    plots: tuple[str, ...] = ()
    x_label: str | None = None


# ---------------------------------------------------------------- claim helpers


def _pick(rows, **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def one(rows, **match) -> dict | None:
    """The first row with every ``key == value`` of ``match``; None when there is none."""
    found = _pick(rows, **match)
    return found[0] if found else None


def claim(text: str, ok: bool, detail: str) -> Claim:
    return Claim(text, bool(ok), detail)


def missing(text: str) -> Claim:
    """A failed claim for runs the CLI flags (``Overrides``) left out."""
    return Claim(text, False, "the runs this claim compares were filtered out")


def by_key(rows, keys):
    """Rows grouped by their values of ``keys``."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def inf_label(q: float) -> str:
    return "inf" if math.isinf(q) else f"{q:g}"


# Per workload and scenario, the multiple of the base program rate (programs/README) that
# overloads the cluster: the S2 misbehaver costs only 2–3.5× a well-behaved client, so tot
# and judge need more load for it to matter (programs.workloads docstring).
RATE_SCALE = {
    ("tot", "s1"): 1.0,
    ("tot", "s2"): 2.5,
    ("judge", "s1"): 1.0,
    ("judge", "s2"): 1.6,
    ("longqa", "s1"): 1.0,
    ("longqa", "s2"): 1.0,
}
