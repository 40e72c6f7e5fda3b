"""Named multi-GPU experiments: the DLPM/D2LPM paper's figures on the cluster simulator.

Each experiment is a list of ``RunSpec``s (router × local policy × dp × workload ×
scenario, sometimes a swept value) and claims about the resulting rows: the property the
paper's figure demonstrates, checked on the run itself. ``--quick`` keeps the same rates and
shapes with fewer minutes of arrivals (and fewer sweep points) so a whole experiment runs
in seconds to a few minutes on a laptop.

This module is the registry (``EXPERIMENTS``, in the order ``list`` shows them) and the
runner, with the CLI flags that narrow an experiment (``Overrides``). The experiments live in
``cluster_grid``, ``cluster_sweeps``, ``cluster_timelines`` and ``cluster_replicas``; what
they share in ``cluster_base``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_fair.experiment.registry import ExperimentEntry, ExperimentOutput, RunOptions, register
from sgl_fair.experiment.show import print_claims, print_rows
from sgl_fair.workloads.combos import D2LPM, Combo

from .cluster_base import ClusterExperiment
from .cluster_grid import GRID
from .cluster_replicas import REPLICAS_EXP
from .cluster_runs import RunSpec, run_many
from .cluster_sweeps import CLIENTS, D2LPM_QUANTUM, DLPM_QUANTUM
from .cluster_timelines import CHAT_FLOOD, MIXED, TIMELINE

# What ``run_cluster_experiment`` returns: the one result shape (``registry``).
ClusterExperimentResult = ExperimentOutput


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


def _combo_key(c: Combo) -> tuple:
    return (c.label, c.router, c.local, repr(c.router_opts), repr(c.local_opts))


def apply_overrides(specs: Sequence[RunSpec], ov: Overrides) -> list[RunSpec]:
    """Set each given dimension on every run (dropping duplicates): on a sweep this selects
    a slice (``--dp 4``), on a fixed setting it changes it (``--gpu H100-80GB``). A router or
    local policy not among the experiment's pairings makes one pairing of them."""
    combos = {_combo_key(s.combo): s.combo for s in specs}
    replacement: Combo | None = None
    keep = set(combos)
    if ov.router or ov.local:
        keep = {
            k
            for k, c in combos.items()
            if (ov.router is None or c.router == ov.router)
            and (ov.local is None or c.local == ov.local)
        }
        if not keep:
            base = next(iter(combos.values()))
            router, local = ov.router or base.router, ov.local or base.local
            replacement = Combo(f"{router}+{local}", router, local)
    # A value some runs have already selects them (a slice of a sweep: the grid's own runs at
    # --dp 4, with the durations the grid gives that dp); a value none has is set on all.
    dims = {name: getattr(ov, name) for name in ("dp", "workload", "gpu", "model")}
    dims = {name: v for name, v in dims.items() if v is not None}
    selects = {name for name, v in dims.items() if any(getattr(s, name) == v for s in specs)}
    scenario = None if ov.scenario in (None, "none") else ov.scenario
    # a scenario some runs have selects them, with their own rates (S2 is S1's clients at
    # x2.5: setting "s2" on S1's runs made S2 at S1's rate, and dropped the real ones)
    picks_scenario = scenario is not None and any(s.scenario == scenario for s in specs)
    out: list[RunSpec] = []
    seen: set[tuple] = set()
    for s in specs:
        changes: dict[str, Any] = {}
        if replacement is not None:
            changes["combo"] = replacement
        elif _combo_key(s.combo) not in keep:
            continue
        if any(getattr(s, name) != dims[name] for name in selects):
            continue
        for name, value in dims.items():
            if name not in selects:
                changes[name] = value
        if picks_scenario:
            if s.scenario != scenario:
                continue
        elif ov.scenario is not None:
            changes["scenario"] = scenario
        elif ov.workload == "chat":
            changes["scenario"] = None  # chat is the Fig. 8 flood: it has no S1/S2
        s = s.replace(**changes) if changes else s
        key = (_combo_key(s.combo), s.dp, s.workload, s.scenario, s.gpu, s.model, s.x, s.duration_s,
               s.replicas, s.report_period_s, s.shared_state, s.fault, s.rate_scale)  # fmt: skip
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
) -> ExperimentOutput:
    specs = exp.build(quick, seed)
    if overrides is not None and overrides.any():
        specs = apply_overrides(specs, overrides)
    t0 = time.perf_counter()
    rows = run_many(specs, jobs=jobs, progress=progress)
    return ExperimentOutput(
        exp, quick, seed, rows, exp.claims(rows), wall_s=time.perf_counter() - t0
    )


# ---------------------------------------------------------------- the registry


def _single_specs(quick: bool, seed: int) -> list[RunSpec]:
    dur = 30.0 if quick else 120.0
    return [RunSpec(D2LPM, 4, "tot", "s1", dur, seed=seed)]


# The flags shape this one; it claims nothing.
ONE_RUN = ClusterExperiment(
    "cluster",
    "one run",
    "one configuration from the flags (default: D2LPM+DLPM, 4 × A100-80GB, ToT S1)",
    _single_specs,
    lambda rows: [],
)

EXPERIMENTS: dict[str, ClusterExperiment] = {
    exp.name: exp
    for exp in (
        GRID,
        DLPM_QUANTUM,
        D2LPM_QUANTUM,
        TIMELINE,
        CLIENTS,
        MIXED,
        CHAT_FLOOD,
        REPLICAS_EXP,
        ONE_RUN,
    )
}


def get_cluster_experiment(name: str) -> ClusterExperiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ValueError(f"unknown cluster experiment {name!r}") from None


# ---------------------------------------------------------------- the experiment registry

QUICK = {"runs": "fewer minutes of arrivals and sweep points (each build(quick=True))"}
FLAGS = frozenset(("dp", "router", "local", "workload", "scenario", "gpu", "model", "jobs"))


def _check(flags: Mapping[str, Any]) -> None:
    scenario = flags.get("scenario")
    if scenario is not None and scenario not in ("s1", "s2", "none"):
        raise ValueError(f"--scenario must be s1, s2 or none (got {scenario!r})")


def _progress_printer(name: str) -> Callable[[int, int, dict], None]:
    def show(done: int, total: int, row: dict) -> None:
        print(
            f"  [{done}/{total}] {row['policy']} dp={row['dp']} {row['workload']} "
            f"{row['scenario'] or ''} ({row['sim_wall_s']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    return show


def _entry(exp: ClusterExperiment) -> ExperimentEntry:
    def run(o: RunOptions) -> ExperimentOutput:
        f = o.flags
        ov = Overrides(**{k: f.get(k) for k in Overrides.__dataclass_fields__})
        progress = None if o.json else _progress_printer(exp.name)
        return run_cluster_experiment(
            exp, quick=o.quick, seed=o.seed, overrides=ov, jobs=f.get("jobs"), progress=progress
        )

    def show(result: ExperimentOutput, paths: dict) -> None:
        from sgl_fair.workloads.cluster_report import table

        header, body = table(result.rows)
        print_rows(f"{exp.name} ({exp.figure}) — {exp.description}", header, body)
        print_claims(result.claims)
        print(f"report: {paths['report']}  (results.json and plots alongside)")

    def write(result: ExperimentOutput, out: Path) -> dict[str, Path]:
        from sgl_fair.workloads.cluster_report import write_cluster_outputs

        return write_cluster_outputs(result, out)

    return ExperimentEntry(
        exp.name, exp.figure, exp.description, run, quick=QUICK,
        flags=FLAGS, check=_check, write=write, show=show,
    )  # fmt: skip


for _exp in EXPERIMENTS.values():
    register(_entry(_exp), family=__name__)
