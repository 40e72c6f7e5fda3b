"""Program workloads: clients issuing programs at Gamma-process rates (the DLPM paper's §6–7).

::

    workload("tot", "s1", dp=2) ──> [ProgramClient, ...] ──generate_programs──> [Program, ...]

Clients ``c0, c1, …``. In S1/S2 (Tab. 3) ``c0`` misbehaves, every other client is
well-behaved; all send programs at the same rate unless the scenario says otherwise:

========  =================================  ========================================
workload  S1: more requests                  S2: longer prefix
========  =================================  ========================================
tot       trees of 4 branches (340 calls)    +Uniform(1500, 2500) tokens before the question
judge     16 dimensions (17 calls)           +600 tokens before each article
longqa    4× the program rate                documents 3× longer
========  =================================  ========================================

``chat`` is Fig. 8: ``c0 … c3`` with bursty conversation arrivals (Gamma cv 3); ``c2`` and
``c3`` flood at 8× the rate from the start and ``c2`` returns to normal halfway through
(it takes only ``scenario=None``; clients past ``c3`` are well-behaved). ``mixed`` is Fig. 12:
``c0`` tot, ``c1`` judge, ``c2`` longqa, ``c3`` chat, repeating, each at its kind's rate; in
S1/S2 ``c0`` misbehaves as in its kind's row above.

Base rates: programs per second per client per GPU (× ``dp`` × ``rate_scale``), the same
for S1 and S2. They are set so that, on one A100-80GB serving Llama-3.1-8B (the paper's
setup), the well-behaved clients leave room and an S1 misbehaver pushes the total to ~1.25×
what the GPU can serve. Implied mean demand per client at dp=1, rate_scale=1, in tokens/s:
prompt / new / output, where "new" is prompt tokens not already in an ideal per-client
cache; (GPU) is the fraction of one GPU that demand needs by the simulator's ``CostModel``
(decode at batch 128: ~5.8k tokens/s; prefill ~13.7k tokens/s)::

    workload rate/s  well-behaved client    c0 misbehaving                  GPU, 4 clients
    tot      0.16    3.2k/93/537   (0.09)   S1 39.2k/890/6.1k    (0.99)     S1 1.25
                                            S2 12.7k/411/537     (0.20)     S2 0.46
    judge    1.0     3.3k/1.1k/451 (0.17)   S1 19.3k/4.0k/2.6k   (0.79)     S1 1.30
                                            S2 5.1k/1.7k/451     (0.24)     S2 0.74
    longqa   0.3     10.3k/1.8k/72 (0.18)   S1 41.1k/7.0k/286    (0.72)     S1 1.26
                                            S2 30.5k/5.1k/72     (0.62)     S2 1.16
    chat     0.5     1.9k/167/414  (0.09)   c2, c3 15.5k/1.3k/3.3k (0.68)   1.54, then 0.94
    mixed    each kind's rate                                               0.53; S1 1.43; S2 0.64

S2 overloads only ``longqa`` at these rates (its misbehaver is 2–3.5× a well-behaved client,
not 5–11× as in S1): raise ``rate_scale`` (~2.5 for tot, ~1.6 for judge) to overload the
others. ToT S1 is decode-bound: a larger running batch than 128 raises capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from ..arrivals import ArrivalProcess, Gamma, Phases
from ..lengths import Uniform
from .base import PROGRAMS, Program, make_config, program_class

WORKLOADS = ("tot", "judge", "longqa", "chat", "mixed")
SCENARIOS = ("s1", "s2")

# Programs per second, per client, per GPU (see the module docstring for what they imply).
BASE_RATE_PER_S: Mapping[str, float] = MappingProxyType(
    {"tot": 0.16, "judge": 1.0, "longqa": 0.3, "chat": 0.5}
)
DEFAULT_CV = 2.0
CHAT_CV = 3.0
CHAT_FLOOD_FACTOR = 8.0
MIXED_ORDER = ("tot", "judge", "longqa", "chat")


class Misbehaviour(NamedTuple):
    params: Mapping[str, Any]
    rate_factor: float


# Tab. 3 of the DLPM paper: how c0 misbehaves, per kind and scenario.
MISBEHAVIOUR: Mapping[str, Mapping[str, Misbehaviour]] = MappingProxyType(
    {
        "tot": {
            "s1": Misbehaviour({"branches": 4}, 1.0),
            "s2": Misbehaviour({"extra_question_len": Uniform(1500, 2500)}, 1.0),
        },
        "judge": {
            "s1": Misbehaviour({"dimensions": 16}, 1.0),
            "s2": Misbehaviour({"extra_prefix": 600}, 1.0),
        },
        "longqa": {
            "s1": Misbehaviour({}, 4.0),
            "s2": Misbehaviour({"doc_scale": 3.0}, 1.0),
        },
    }
)

# SeedSequence tags, so program streams never meet the arrival streams.
_TAG_ARRIVALS, _TAG_PROGRAM = 11, 12


@dataclass(frozen=True)
class ProgramClient:
    """One client issuing programs of one ``kind`` at the start times ``arrivals`` gives.

    ``params`` are the kind's config fields (e.g. ``{"branches": 4}``); ``weight`` is the
    client's fair-share weight for weighted policies (generation ignores it).
    """

    client: str
    kind: str
    arrivals: ArrivalProcess
    params: Mapping[str, Any] = field(default_factory=dict)
    well_behaved: bool = True
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.client, str) or not self.client:
            raise ValueError("ProgramClient: field 'client' must be a non-empty string")
        where = f"ProgramClient {self.client!r}"
        if self.kind not in PROGRAMS:
            raise ValueError(
                f"{where}: field 'kind' must be one of {tuple(PROGRAMS)} (got {self.kind!r})"
            )
        if not isinstance(self.arrivals, ArrivalProcess):
            raise ValueError(f"{where}: field 'arrivals' needs a times() method")
        if not isinstance(self.params, Mapping):
            raise ValueError(f"{where}: field 'params' must be a mapping")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        try:
            make_config(self.kind, dict(self.params))
        except ValueError as e:
            raise ValueError(f"{where}: field 'params': {e}") from None
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
            raise ValueError(f"{where}: field 'weight' must be > 0 (got {w!r})")


def generate_programs(
    clients: Sequence[ProgramClient], duration_s: float, *, seed: int = 0
) -> list[Program]:
    """The clients' programs starting in ``[0, duration_s)``, sorted by (start, client order).

    Spec ``k``'s start times come from a stream seeded by ``(seed, k)`` and its ``j``-th
    program from ``(seed, k, j)``, so adding a client leaves every other program as it was.
    Program ids are ``f"{client}-{kind}-{i}"``, ``i`` counting the client's programs in order;
    a client's programs of one kind share its header (seeded by ``seed``).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0 (got {seed!r})")
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"duration_s must be a finite number >= 0 (got {duration_s!r})")
    rows = []  # (start_s, spec index, j): sorts to the output order
    for k, spec in enumerate(clients):
        rng = np.random.default_rng([seed, _TAG_ARRIVALS, k])
        times = spec.arrivals.times(0.0, float(duration_s), rng)
        rows.extend((t, k, j) for j, t in enumerate(times))
    rows.sort()

    configs = [make_config(spec.kind, dict(spec.params)) for spec in clients]
    programs: list[Program] = []
    counts: dict[str, int] = {}
    for t, k, j in rows:
        spec = clients[k]
        i = counts.get(spec.client, 0)
        counts[spec.client] = i + 1
        program_seed = np.random.SeedSequence([seed, _TAG_PROGRAM, k, j]).generate_state(1)[0]
        programs.append(
            program_class(spec.kind)(
                f"{spec.client}-{spec.kind}-{i}",
                spec.client,
                start_s=t,
                seed=int(program_seed),
                well_behaved=spec.well_behaved,
                shared_seed=seed,
                config=configs[k],
            )
        )
    return programs


def _need_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"field {name!r} must be an integer >= {minimum} (got {value!r})")


def _need_number(name: str, value: Any, *, positive: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"field {name!r} must be a number {'> 0' if positive else '>= 0'}")


def workload(
    name: str,
    scenario: str | None = None,
    *,
    dp: int = 1,
    num_clients: int = 4,
    rate_scale: float = 1.0,
    cv: float | None = None,
    duration_s: float | None = None,
) -> list[ProgramClient]:
    """The named workload's clients (see the module docstring).

    Program rates are ``BASE_RATE_PER_S[kind] × dp × rate_scale`` per client (the paper
    raises the rate with the number of GPUs). ``cv``: the Gamma arrivals' coefficient of
    variation (default 2; chat 3). ``duration_s`` is required by ``chat`` (its flood ends
    halfway) and ignored otherwise.
    """
    if name not in WORKLOADS:
        raise ValueError(f"field 'name' must be one of {WORKLOADS} (got {name!r})")
    if scenario is not None and scenario not in SCENARIOS:
        raise ValueError(f"field 'scenario' must be None or one of {SCENARIOS} (got {scenario!r})")
    _need_int("dp", dp, 1)
    _need_int("num_clients", num_clients, 2 if scenario is not None else 1)
    _need_number("rate_scale", rate_scale, positive=True)
    if cv is not None:
        _need_number("cv", cv, positive=False)
    scale = dp * rate_scale

    if name == "chat":
        return _chat_flood(scenario, num_clients, scale, cv, duration_s)
    if name == "mixed":
        kinds = [MIXED_ORDER[i % len(MIXED_ORDER)] for i in range(num_clients)]
    else:
        kinds = [name] * num_clients
    cv = DEFAULT_CV if cv is None else cv
    out = []
    for i, kind in enumerate(kinds):
        params: Mapping[str, Any] = {}
        factor, misbehaving = 1.0, i == 0 and scenario is not None
        if misbehaving:
            params, factor = MISBEHAVIOUR[kind][scenario]
        rate = BASE_RATE_PER_S[kind] * scale * factor
        out.append(ProgramClient(f"c{i}", kind, Gamma(rate, cv), params, not misbehaving))
    return out


def _chat_flood(
    scenario: str | None,
    num_clients: int,
    scale: float,
    cv: float | None,
    duration_s: float | None,
) -> list[ProgramClient]:
    if scenario is not None:
        raise ValueError(
            "field 'scenario': workload 'chat' is the paper's Fig. 8 flood (c2 and c3 "
            f"misbehave) and takes scenario=None (got {scenario!r})"
        )
    _need_int("num_clients", num_clients, 4)
    if duration_s is None:
        raise ValueError("field 'duration_s' is required by workload 'chat' (c2 stops midway)")
    _need_number("duration_s", duration_s, positive=True)
    cv = CHAT_CV if cv is None else cv
    rate = BASE_RATE_PER_S["chat"] * scale
    normal, flood = Gamma(rate, cv), Gamma(rate * CHAT_FLOOD_FACTOR, cv)
    half_s = duration_s / 2
    out = []
    for i in range(num_clients):
        arrivals: ArrivalProcess = normal
        if i == 2:
            arrivals = Phases(((half_s, flood), (duration_s - half_s, normal)))
        elif i == 3:
            arrivals = flood
        out.append(ProgramClient(f"c{i}", "chat", arrivals, {}, well_behaved=i not in (2, 3)))
    return out


class ClientDemand(NamedTuple):
    num_programs: int
    num_calls: int
    input_tokens: int  # prompt tokens over all calls, shared prefixes counted per call
    output_tokens: int


def program_demand(programs: Sequence[Program]) -> dict[str, ClientDemand]:
    """Per client: programs, calls and tokens they would issue if run to completion."""
    totals: dict[str, list[int]] = {}
    for p in programs:
        row = totals.setdefault(p.client, [0, 0, 0, 0])
        row[0] += 1
        row[1] += p.num_calls
        row[2] += p.input_tokens
        row[3] += p.output_tokens
    return {client: ClientDemand(*row) for client, row in totals.items()}
