"""Program- and client-level latency and service metrics over request records.

Shared by the simulated cluster runs (``sgl_fair.experiment``) and the live load test
(``harness``), so both measure programs and well-behaved clients the same way:

* a program's latency runs from its first call issued to its last call finished; a program
  still unfinished at ``t_end_s`` counts with its age then (a lower bound);
* ``p50_well_behaved_s`` / ``p99_well_behaved_s`` are the mean over well-behaved clients of
  each client's P50 / P99 program latency, or with ``use_ttft`` of its calls' TTFT;
* service is what clients are billed (``PERCEIVED``: input + 2 × output tokens) or what the
  GPU did (``ACTUAL``: extend + 2 × output tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from sgl_fair import metrics
from sgl_fair.cost import PrefixAwareTokens, WeightedTokens
from sgl_fair.records import RequestRecord, ServiceEvent
from sgl_fair.request import Request
from sgl_fair.workloads.programs import Program

PERCEIVED = WeightedTokens()  # what clients are billed: input + 2 × output
ACTUAL = PrefixAwareTokens()  # what the GPU did: extend + 2 × output


def mean_or_none(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return float(np.mean(xs)) if xs else None


def program_latencies_of(
    programs: Sequence[Program], calls: Sequence[Request | RequestRecord], t_end_s: float
) -> dict[str, list[float]]:
    """``program_latencies`` from its parts, so a live load test (``harness``) measures
    programs exactly as the simulated runs do: first call issued (the program's start) → last
    call finished; a program still unfinished at ``t_end_s`` counts with its age then."""
    finish: dict[str, float] = {}
    for r in calls:
        if r.finish_s is not None and r.interaction_id is not None:
            finish[r.interaction_id] = max(finish.get(r.interaction_id, 0.0), r.finish_s)
    out: dict[str, list[float]] = defaultdict(list)
    for prog in programs:
        if prog.start_s > t_end_s:
            continue
        end = finish.get(prog.program_id, t_end_s) if prog.done else t_end_s
        out[prog.client].append(end - prog.start_s)
    return out


def well_behaved_latency_of(
    programs: Sequence[Program],
    records: Sequence[RequestRecord],
    well_behaved: set[str],
    *,
    t_end_s: float,
    use_ttft: bool,
) -> dict[str, float | None]:
    """``p50_well_behaved_s`` / ``p99_well_behaved_s`` (see the module docstring) from a run's
    programs and records: shared by the simulated runs and the live load test."""
    p = {
        c: metrics.percentiles(v)
        for c, v in client_latencies(
            programs, records, t_end_s=t_end_s, use_ttft=use_ttft, clients=well_behaved
        ).items()
    }
    return {
        "p50_well_behaved_s": mean_or_none([q[50] for q in p.values()]),
        "p99_well_behaved_s": mean_or_none([q[99] for q in p.values()]),
    }


def client_latencies(
    programs: Sequence[Program],
    records: Sequence[RequestRecord],
    *,
    t_end_s: float,
    use_ttft: bool,
    clients: set[str] | None = None,
) -> dict[str, list[float]]:
    """Per client (of ``clients``; default all): the latencies the well-behaved metric takes
    percentiles of: program end-to-end latencies, or with ``use_ttft`` each non-rejected
    call's TTFT (an unserved call counts with its wait until ``t_end_s``, a lower bound)."""
    if use_ttft:
        by_client: dict[str, list[float]] = defaultdict(list)
        for r in records:
            if (clients is None or r.client in clients) and not r.rejected:
                ttft = r.ttft_s if r.ttft_s is not None else t_end_s - r.arrival_s
                by_client[r.client].append(ttft)
        return by_client
    lat = program_latencies_of(programs, records, t_end_s)
    return {c: v for c, v in lat.items() if clients is None or c in clients}


def service_series(
    events: Sequence[ServiceEvent], records: Sequence[RequestRecord], t_end: float
) -> dict:
    """Per-client service rates (perceived and actual) and response times over time, the
    ``series`` of a row that ``cluster_report.plot_timeline`` draws (JSON-able)."""
    window = max(t_end / 40, 1.0)
    step = window / 2
    out: dict[str, Any] = {"window_s": window}
    for name, cost in (("perceived", PERCEIVED), ("actual", ACTUAL)):
        times, rates = metrics.service_rate_series(
            events, cost, window_s=window, t_end=t_end, step_s=step
        )
        out["t"] = times.tolist()
        out[name] = {c: v.tolist() for c, v in rates.items()}
    # Response time: each finished call's end-to-end latency at its finish time.
    resp: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r.finish_s is not None:
            resp[r.client].append((round(r.finish_s, 3), round(r.finish_s - r.arrival_s, 3)))
    out["response"] = {c: sorted(v) for c, v in resp.items()}
    return out
