"""One experiment registry and one result shape, for every family of experiments.

Every named experiment — the VTC figures (``vtc``), the cluster ones (``cluster``), BROS's
(``bros``) and FairServe's (``fairserve``) — is an ``ExperimentEntry``: its name, figure,
description, runner, what ``--quick`` changes, the CLI flags that narrow it, and how its
outputs are written and shown. ``EXPERIMENTS`` lists them in the order ``list`` shows them;
each family module registers its own with ``register`` when first imported.

Every runner returns an ``ExperimentOutput``: the experiment, ``quick``, ``seed``, the rows
and the claims checked on them, plus the family's own JSON keys in one place (``extras``,
written after ``seed``/``duration_s`` and before ``rows``) and its in-memory detail for
reports and plots (``runs``, never written). ``to_json`` is the one results.json shape.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Claim:
    """A check of the property a paper's figure demonstrates, evaluated on the run itself."""

    text: str
    passed: bool
    detail: str = ""


_HEAD = ("experiment", "figure", "description", "quick", "seed")


@dataclass
class ExperimentOutput:
    """What every experiment returns. ``experiment``: what ran (anything with ``name``,
    ``figure`` and ``description``: the family's record); ``duration_s``: virtual seconds of
    arrivals (None where runs differ); ``wall_s``: written as ``sim_wall_s`` when given."""

    experiment: Any
    quick: bool
    seed: int
    rows: list[dict[str, Any]]
    claims: list[Claim] | list[dict[str, Any]]
    extras: dict[str, Any] = field(default_factory=dict)
    duration_s: float | None = None
    wall_s: float | None = None
    runs: Any = None  # the family's per-run detail (reports, plots); not in the JSON

    @classmethod
    def from_json(cls, experiment: Any, data: Mapping[str, Any]) -> ExperimentOutput:
        """The result a family built as a results.json dict (BROS, FairServe: their claims
        are dicts that may carry more keys, kept as they are); every key other than the
        common ones becomes an extra, in its order."""
        common = {*_HEAD, "duration_s", "rows", "claims", "all_claims_passed", "sim_wall_s"}
        return cls(
            experiment,
            data["quick"],
            data["seed"],
            data["rows"],
            data["claims"],
            extras={k: v for k, v in data.items() if k not in common},
            duration_s=data.get("duration_s"),
            wall_s=data.get("sim_wall_s"),
        )

    @property
    def num_runs(self) -> int:
        return len(self.rows)

    @property
    def all_claims_passed(self) -> bool | None:
        """Whether every claim passed; None for a result with no claims (a run that checks
        nothing passes nothing: ``True`` there read as a check that held)."""
        if not self.claims:
            return None
        return all(c["passed"] if isinstance(c, dict) else c.passed for c in self.claims)

    def to_json(self) -> dict[str, Any]:
        exp = self.experiment
        data: dict[str, Any] = {
            "experiment": exp.name,
            "figure": exp.figure,
            "description": exp.description,
            "quick": self.quick,
            "seed": self.seed,
        }
        if self.duration_s is not None:
            data["duration_s"] = self.duration_s
        data.update(self.extras)
        data["rows"] = self.rows
        data["claims"] = [c if isinstance(c, dict) else c.__dict__ for c in self.claims]
        data["all_claims_passed"] = self.all_claims_passed
        if self.wall_s is not None:
            data["sim_wall_s"] = round(self.wall_s, 3)
        return data


@dataclass(frozen=True)
class RunOptions:
    """One ``run`` command: ``--quick``, ``--seed``, whether JSON goes to stdout (no
    progress lines then), and the narrowing flags given (``flags``: name -> value)."""

    quick: bool = False
    seed: int = 0
    json: bool = False
    flags: Mapping[str, Any] = field(default_factory=dict)


def write_results_json(result: ExperimentOutput, out_dir: Path) -> dict[str, Path]:
    """The default writer: ``results.json`` only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return {"results": path}


@dataclass(frozen=True)
class ExperimentEntry:
    """A named experiment. ``run(options)`` runs it; ``quick``: the settings ``--quick``
    changes (documentation and tests: each runner reads its own); ``flags``: the narrowing
    CLI flags it takes (``dp``, ``router``, ...; any other given is a usage error) and
    ``check(flags)`` its own checks of their values (a ``ValueError``: a usage error);
    ``write(result, out_dir)`` writes its outputs and returns their paths (``results`` and,
    where there is one, ``report``); ``show(result, paths)`` prints it for a terminal."""

    name: str
    figure: str
    description: str
    run: Callable[[RunOptions], ExperimentOutput]
    quick: Mapping[str, Any] = field(default_factory=dict)
    flags: frozenset[str] = frozenset()
    check: Callable[[Mapping[str, Any]], None] | None = None
    write: Callable[[ExperimentOutput, Path], dict[str, Path]] = write_results_json
    show: Callable[[ExperimentOutput, dict[str, Path]], None] | None = None


# The family modules, in the order ``list`` shows their experiments; importing one runs its
# ``register`` calls (a family outside this list may register too; it is listed last).
FAMILIES = (
    "sgl_fair.experiment.vtc",
    "sgl_fair.experiment.cluster",
    "sgl_fair.experiment.fairserve",
    "sgl_fair.experiment.bros",
)


class Registry:
    def __init__(self) -> None:
        self._entries: dict[str, ExperimentEntry] = {}
        self._family: dict[str, str] = {}
        self._loaded = False

    def register(self, entry: ExperimentEntry, *, family: str) -> ExperimentEntry:
        """File ``entry`` under its name; ``family``: the registering module's ``__name__``
        (``list`` shows the families in ``FAMILIES`` order, each in registration order)."""
        if entry.name in self._entries:
            raise ValueError(f"experiment {entry.name!r} registered twice")
        self._entries[entry.name] = entry
        self._family[entry.name] = family
        return entry

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in FAMILIES:
                importlib.import_module(module)

    def names(self) -> list[str]:
        self._load()
        order = {m: i for i, m in enumerate(FAMILIES)}
        return sorted(self._entries, key=lambda n: order.get(self._family[n], len(order)))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[ExperimentEntry]:
        return iter([self._entries[n] for n in self.names()])

    def get(self, name: str) -> ExperimentEntry:
        """The entry ``name``; an unknown name is a one-line ``ValueError`` naming them all."""
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown experiment {name!r} (known: {', '.join(self.names())})"
            ) from None


EXPERIMENTS = Registry()
register = EXPERIMENTS.register
