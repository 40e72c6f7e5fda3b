"""Named multi-GPU experiments: the DLPM/D2LPM paper's figures on the cluster simulator.

Each experiment is a list of ``RunSpec``s (router × local policy × dp × workload ×
scenario, sometimes a swept value) and claims about the resulting rows: the property the
paper's figure demonstrates, checked on the run itself. ``--quick`` keeps the same rates and
shapes with fewer minutes of arrivals (and fewer sweep points) so a whole experiment runs
in seconds to a few minutes on a laptop.

Defaults chosen from the sweeps (see ``dlpm-quantum`` and ``d2lpm-quantum``): DLPM's
``Q = DEFAULT_Q`` and D2LPM's ``Q_u = DEFAULT_QU``; BENCHMARKS.md records the numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .cluster_runs import Combo, RunSpec, run_many
from .experiments import Claim

DEFAULT_Q = 2048.0  # DLPM's quantum (the policy's default)
DEFAULT_QU = 10_000.0  # D2LPM's per-worker quantum (the router policy's default)

D2LPM = Combo("D2LPM", "d2lpm", "dlpm")
RR_LPM = Combo("RR+LPM", "rr", "lpm")
PREBLE = Combo("Preble", "preble", "lpm")
VTC = Combo("VTC", "per-client-rr", "vtc")
CACHE_AWARE = Combo("CacheAware+LPM", "cache-aware", "lpm")
GRID_COMBOS = (D2LPM, RR_LPM, PREBLE, VTC, CACHE_AWARE)
# One GPU: the router is irrelevant, only the local policy differs.
LPM1 = Combo("LPM", "rr", "lpm")
VTC1 = Combo("VTC", "rr", "vtc")
DLPM1 = Combo("DLPM", "rr", "dlpm")


@dataclass(frozen=True)
class ClusterExperiment:
    name: str
    figure: str
    description: str
    build: Callable[[bool, int], list[RunSpec]]  # (quick, seed) -> runs
    claims: Callable[[list[dict[str, Any]]], list[Claim]]
    plots: tuple[str, ...] = ()
    x_label: str | None = None


@dataclass
class ClusterExperimentResult:
    experiment: ClusterExperiment
    quick: bool
    seed: int
    rows: list[dict[str, Any]]
    claims: list[Claim]
    wall_s: float

    @property
    def num_runs(self) -> int:
        return len(self.rows)

    def to_json(self) -> dict[str, Any]:
        exp = self.experiment
        return {
            "experiment": exp.name,
            "figure": exp.figure,
            "description": exp.description,
            "quick": self.quick,
            "seed": self.seed,
            "rows": self.rows,
            "claims": [c.__dict__ for c in self.claims],
            "all_claims_passed": all(c.passed for c in self.claims),
            "sim_wall_s": round(self.wall_s, 3),
        }


# ---------------------------------------------------------------- overrides (CLI flags)


@dataclass(frozen=True)
class Overrides:
    """CLI flags that narrow or change an experiment's runs (None = keep)."""

    dp: int | None = None
    router: str | None = None
    local: str | None = None
    workload: str | None = None
    scenario: str | None = None
    gpu: str | None = None
    model: str | None = None

    def any(self) -> bool:
        return any(v is not None for v in self.__dict__.values())


def apply_overrides(specs: Sequence[RunSpec], ov: Overrides) -> list[RunSpec]:
    """Set each given dimension on every run (dropping duplicates): on a sweep this selects
    a slice (``--dp 4``), on a fixed setting it changes it (``--gpu H100-80GB``). A router or
    local policy not among the experiment's pairings makes one pairing of them."""
    out: list[RunSpec] = []
    seen: set[tuple] = set()
    combos = {s.combo for s in specs}
    if ov.router or ov.local:
        keep = {
            c
            for c in combos
            if (ov.router is None or c.router == ov.router)
            and (ov.local is None or c.local == ov.local)
        }
        if not keep:
            base = next(iter(combos))
            router, local = ov.router or base.router, ov.local or base.local
            keep = {Combo(f"{router}+{local}", router, local)}
    else:
        keep = combos
    for s in specs:
        if s.combo not in keep and len(keep) > 1:
            continue
        changes: dict[str, Any] = {}
        if s.combo not in keep:
            changes["combo"] = next(iter(keep))
        for name in ("dp", "workload", "gpu", "model"):
            value = getattr(ov, name)
            if value is not None:
                changes[name] = value
        if ov.scenario is not None:
            changes["scenario"] = None if ov.scenario == "none" else ov.scenario
        s = s.replace(**changes) if changes else s
        key = (s.combo, s.dp, s.workload, s.scenario, s.gpu, s.model, s.x, s.num_clients)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def run_cluster_experiment(
    exp: ClusterExperiment,
    *,
    quick: bool = False,
    seed: int = 0,
    overrides: Overrides | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
) -> ClusterExperimentResult:
    specs = exp.build(quick, seed)
    if overrides is not None and overrides.any():
        specs = apply_overrides(specs, overrides)
    t0 = time.perf_counter()
    rows = run_many(specs, jobs=jobs, progress=progress)
    return ClusterExperimentResult(
        experiment=exp,
        quick=quick,
        seed=seed,
        rows=rows,
        claims=exp.claims(rows),
        wall_s=time.perf_counter() - t0,
    )


# ---------------------------------------------------------------- claim helpers


def _pick(rows, **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _one(rows, **match) -> dict | None:
    found = _pick(rows, **match)
    return found[0] if found else None


def _fmt(x: float | None, spec: str = "{:.3g}") -> str:
    return "-" if x is None else spec.format(x)


def _claim(text: str, ok: bool, detail: str) -> Claim:
    return Claim(text, bool(ok), detail)


def _missing(text: str) -> Claim:
    return Claim(text, False, "the runs this claim compares were filtered out")


# ---------------------------------------------------------------- experiments

EXPERIMENTS: dict[str, ClusterExperiment] = {}


def _register(exp: ClusterExperiment) -> ClusterExperiment:
    EXPERIMENTS[exp.name] = exp
    return exp


def get_cluster_experiment(name: str) -> ClusterExperiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown cluster experiment {name!r}") from None


def _inf_label(q: float) -> str:
    return "inf" if math.isinf(q) else f"{q:g}"
