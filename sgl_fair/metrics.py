"""Fairness, latency and throughput metrics: pure functions of a run's records.

Every metric reads only ``ServiceEvent``s and ``RequestRecord``s (``sgl_fair.records``)
and a ``CostFunction`` (default ``WeightedTokens()``: ``w_in = 1``, ``w_out = 2``), so the
simulator, the live server and the SGLang backend report through the same code (SPEC §0).

Runs can hold ~10^6 events. ``EventArrays`` (``sgl_fair/event_arrays.py``) turns them into
numpy arrays once (time, client index, service) and every event metric accepts either raw
events or an ``EventArrays``; ``summarize`` builds it once and reuses it.

Interval conventions (all times in seconds, on the run's own clock):

* service "in [t0, t1)" counts events with ``t0 <= t_s < t1`` (windows tile without overlap);
* accumulated service "at t" counts events with ``t_s <= t`` (everything delivered by t);
* throughput counts events in the closed interval ``[t0, t1]``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from sgl_fair.cost import CostFunction
from sgl_fair.event_arrays import EventArrays
from sgl_fair.event_arrays import as_arrays as _arrays
from sgl_fair.records import RequestRecord, ServiceEvent
from sgl_fair.request import ClientId


def _rows(arrays: EventArrays, matrix: np.ndarray, clients: Iterable[ClientId] | None) -> dict:
    """Map rows of a per-client matrix to client names; unknown clients get zeros."""
    index = {c: i for i, c in enumerate(arrays.clients)}
    names = arrays.clients if clients is None else tuple(clients)
    zeros = np.zeros(matrix.shape[1:])
    return {c: (matrix[index[c]] if c in index else zeros.copy()) for c in names}


def _opt(x: float | None) -> float | None:
    """A JSON-safe float: ``None`` for missing or NaN, else a plain Python float."""
    return None if x is None or math.isnan(x) else float(x)


# --- fairness ----------------------------------------------------------------------------


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index ``(Σx)^2 / (n Σx^2)``: 1 when all equal, 1/n when one takes all.

    All-zero input returns 1.0 (everyone received the same: nothing). Raises ``ValueError``
    on empty input or negative values (the index is defined for non-negative allocations).
    """
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        raise ValueError("jain_index of no values")
    if np.any(x < 0):
        raise ValueError("jain_index needs non-negative values")
    sum_sq = float(np.dot(x, x))
    if sum_sq == 0.0:
        return 1.0
    return float(x.sum() ** 2 / (x.size * sum_sq))


def per_client_service(
    events: Sequence[ServiceEvent] | EventArrays,
    cost: CostFunction | None = None,
    *,
    t0: float | None = None,
    t1: float | None = None,
) -> dict[ClientId, float]:
    """Total service per client from events in ``[t0, t1)`` (an open end when ``None``)."""
    arrays = _arrays(events, cost)
    mask = np.ones(len(arrays), dtype=bool)
    if t0 is not None:
        mask &= arrays.t_s >= t0
    if t1 is not None:
        mask &= arrays.t_s < t1
    totals = np.bincount(
        arrays.client_idx[mask], weights=arrays.service[mask], minlength=len(arrays.clients)
    )
    return {c: float(totals[i]) for i, c in enumerate(arrays.clients)}


def service_rate_series(
    events: Sequence[ServiceEvent] | EventArrays,
    cost: CostFunction | None = None,
    *,
    window_s: float,
    t_end: float,
    t_start: float = 0.0,
    step_s: float | None = None,
    clients: Iterable[ClientId] | None = None,
) -> tuple[np.ndarray, dict[ClientId, np.ndarray]]:
    """Service per second over sliding windows (VTC's "service rate", ``W(t-T, t) / T``).

    Window k covers ``[e_k - window_s, e_k)`` with ``e_k = t_start + window_s + k * step_s``
    (``step_s`` defaults to ``window_s``: back-to-back windows). Only full windows with
    ``e_k <= t_end`` are produced. Returns ``(times, rates)`` where ``times`` are the window
    *ends* ``e_k`` and ``rates[client]`` is an array aligned with them.
    """
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    step_s = window_s if step_s is None else step_s
    if step_s <= 0:
        raise ValueError("step_s must be positive")
    arrays = _arrays(events, cost)
    span = t_end - t_start - window_s
    num = int(math.floor(span / step_s + 1e-9)) + 1 if span >= -1e-9 * window_s else 0
    ends = t_start + window_s + step_s * np.arange(num, dtype=np.float64)
    rates = (
        arrays.cumulative(ends, inclusive=False)
        - arrays.cumulative(ends - window_s, inclusive=False)
    ) / window_s
    return ends, _rows(arrays, rates, clients)


def accumulated_service(
    events: Sequence[ServiceEvent] | EventArrays,
    cost: CostFunction | None = None,
    *,
    times: Sequence[float] | np.ndarray,
    clients: Iterable[ClientId] | None = None,
) -> dict[ClientId, np.ndarray]:
    """Cumulative service of each client by each time in ``times`` (events with ``t_s <= t``)."""
    arrays = _arrays(events, cost)
    return _rows(arrays, arrays.cumulative(np.asarray(times), inclusive=True), clients)


def accumulated_service_diff(
    events: Sequence[ServiceEvent] | EventArrays,
    cost: CostFunction | None = None,
    *,
    times: Sequence[float] | np.ndarray,
    a: ClientId,
    b: ClientId,
) -> np.ndarray:
    """``|S_a(t) - S_b(t)|`` at each time: the "absolute difference" of VTC Fig. 3a."""
    acc = accumulated_service(events, cost, times=times, clients=(a, b))
    return np.abs(acc[a] - acc[b])


def active_interval(records: Sequence[RequestRecord]) -> tuple[float, float] | None:
    """The interval in which every client is active (sending requests).

    ``[max_c first_arrival_c, min_c last_arrival_c]`` over all submitted requests, rejected
    ones included (a rejected request still shows the client is active). ``None`` when there
    are no records or the interval is empty (``t1 <= t0``).
    """
    first: dict[ClientId, float] = {}
    last: dict[ClientId, float] = {}
    for r in records:
        first[r.client] = min(first.get(r.client, math.inf), r.arrival_s)
        last[r.client] = max(last.get(r.client, -math.inf), r.arrival_s)
    if not first:
        return None
    t0, t1 = max(first.values()), min(last.values())
    return (t0, t1) if t1 > t0 else None


def jain_over_active_interval(
    events: Sequence[ServiceEvent] | EventArrays,
    records: Sequence[RequestRecord],
    cost: CostFunction | None = None,
) -> float | None:
    """Jain's index of per-client service rates in ``[t0, t1)`` of ``active_interval``.

    Every client with a record counts (zero service if it got none). ``None`` when there is
    no active interval.
    """
    interval = active_interval(records)
    if interval is None:
        return None
    t0, t1 = interval
    service = per_client_service(events, cost, t0=t0, t1=t1)
    clients = sorted({r.client for r in records})
    return jain_index([service.get(c, 0.0) / (t1 - t0) for c in clients])


def _demand(cost: CostFunction, r: RequestRecord) -> float:
    """Service a request asks for: its whole prompt (uncached) plus all its output."""
    return cost.input_cost(input_len=r.input_len, extend_len=r.input_len) + cost.output_cost(
        input_len=r.input_len, start=0, end=r.output_len
    )


def service_difference_windows(
    events: Sequence[ServiceEvent] | EventArrays,
    records: Sequence[RequestRecord],
    cost: CostFunction | None = None,
    *,
    window_s: float = 60.0,
    t_start: float | None = None,
    t_end: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """VTC's per-window service difference. Returns ``(window_starts, values)``.

    Windows tile ``[t_start, t_end]``: window k is ``[t_start + k*T, t_start + (k+1)*T)``
    for ``k < n = max(1, ceil((t_end - t_start) / T))``; the last window is closed at
    ``t_end`` and is partial when the span is not a multiple of T. Defaults: ``t_start`` the
    earliest arrival or event, ``t_end`` the last event. In each window, with ``s_j`` the
    service client j received (events) and ``demand_j`` the service its requests arriving in
    the window asked for (``_demand``; rejected requests included), ``max_s = max_j s_j``::

        value = Σ_j min(max_s - s_j, |demand_j - s_j|)

    i.e. a client is short-changed by the gap to the best-served client, but only as far as
    its own demand goes. Clients are all clients seen in events or records.
    """
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    arrays = _arrays(events, cost)
    starts_seen = [r.arrival_s for r in records] + arrays.t_s[:1].tolist()
    if not starts_seen or (len(arrays) == 0 and t_end is None):
        return np.zeros(0), np.zeros(0)
    t_start = min(starts_seen) if t_start is None else t_start
    t_end = float(arrays.t_s[-1]) if t_end is None else t_end
    if t_end < t_start:
        return np.zeros(0), np.zeros(0)
    num = max(1, math.ceil((t_end - t_start) / window_s))
    clients = sorted(set(arrays.clients) | {r.client for r in records})
    index = {c: i for i, c in enumerate(clients)}

    def binned(t: np.ndarray, client: np.ndarray, amount: np.ndarray) -> np.ndarray:
        keep = (t >= t_start) & (t <= t_end)
        k = np.minimum(np.floor((t[keep] - t_start) / window_s).astype(np.int64), num - 1)
        flat = np.bincount(
            k * len(clients) + client[keep], weights=amount[keep], minlength=num * len(clients)
        )
        return flat.reshape(num, len(clients))

    remap = np.array([index[c] for c in arrays.clients], dtype=np.int64)
    served = binned(arrays.t_s, remap[arrays.client_idx], arrays.service)
    demanded = binned(
        np.array([r.arrival_s for r in records], dtype=np.float64),
        np.array([index[r.client] for r in records], dtype=np.int64),
        np.array([_demand(arrays.cost, r) for r in records], dtype=np.float64),
    )
    gap = served.max(axis=1, keepdims=True) - served
    values = np.minimum(gap, np.abs(demanded - served)).sum(axis=1)
    return t_start + window_s * np.arange(num, dtype=np.float64), values


def service_difference(
    events: Sequence[ServiceEvent] | EventArrays,
    records: Sequence[RequestRecord],
    cost: CostFunction | None = None,
    *,
    window_s: float = 60.0,
    t_start: float | None = None,
    t_end: float | None = None,
) -> dict[str, float | None]:
    """Max, mean and population variance of ``service_difference_windows`` (None if no window)."""
    _, values = service_difference_windows(
        events, records, cost, window_s=window_s, t_start=t_start, t_end=t_end
    )
    if values.size == 0:
        return {"max": None, "avg": None, "var": None}
    return {"max": float(values.max()), "avg": float(values.mean()), "var": float(values.var())}


# --- latency, throughput, cache ------------------------------------------------------------


def percentiles(
    values: Iterable[float | None], qs: Sequence[float] = (50, 99)
) -> dict[float, float | None]:
    """Percentiles by linear interpolation (``numpy.percentile`` default).

    ``None`` and NaN values are dropped; with nothing left every percentile is ``None``.
    """
    x = np.array([v for v in values if v is not None], dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return {q: None for q in qs}
    return {q: float(p) for q, p in zip(qs, np.percentile(x, list(qs)), strict=True)}


def _latency_row(records: Sequence[RequestRecord]) -> dict:
    ttft = percentiles(r.ttft_s for r in records)
    e2e = percentiles(r.e2e_s for r in records)
    return {
        "ttft_p50_s": ttft[50],
        "ttft_p99_s": ttft[99],
        "e2e_p50_s": e2e[50],
        "e2e_p99_s": e2e[99],
        "num_requests": len(records),
        "num_finished": sum(r.finish_s is not None for r in records),
        "num_rejected": sum(r.rejected for r in records),
    }


def per_client_latency(records: Sequence[RequestRecord]) -> dict[ClientId, dict]:
    """Per client: TTFT p50/p99 (requests with a first token), end-to-end p50/p99 (finished
    requests), and counts of requests, finished and rejected."""
    by_client: dict[ClientId, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_client[r.client].append(r)
    return {c: _latency_row(by_client[c]) for c in sorted(by_client)}


def program_latency(records: Sequence[RequestRecord]) -> dict[str, float]:
    """End-to-end latency of each finished program (interaction): last finish − first arrival.

    Only records with an ``interaction_id`` count; a program with an unfinished or rejected
    call is left out.
    """
    calls: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.interaction_id is not None:
            calls[r.interaction_id].append(r)
    return {
        pid: max(r.finish_s for r in rs) - min(r.arrival_s for r in rs)
        for pid, rs in calls.items()
        if all(r.finish_s is not None for r in rs)
    }


def throughput(
    records: Sequence[RequestRecord],
    events: Sequence[ServiceEvent] | EventArrays,
    *,
    t0: float | None = None,
    t1: float | None = None,
) -> dict[str, float]:
    """Tokens and requests per second over the closed interval ``[t0, t1]``.

    Tokens are the full ``input_len`` of each PREFILL event (cached prefix included; a
    re-admitted request counts again, as it is processed again) plus the output tokens of
    DECODE events. ``req_s`` counts requests finishing in the interval. Defaults: ``t0`` the
    first arrival (or event), ``t1`` the last finish (or event). A non-positive duration
    yields zeros.
    """
    arrays = _arrays(events, None)  # token counts do not depend on the cost
    arrivals = [r.arrival_s for r in records]
    finishes = [r.finish_s for r in records if r.finish_s is not None]
    if t0 is None:
        t0 = min(arrivals) if arrivals else (float(arrays.t_s[0]) if len(arrays) else 0.0)
    if t1 is None:
        t1 = max(finishes) if finishes else (float(arrays.t_s[-1]) if len(arrays) else t0)
    duration = t1 - t0
    if duration <= 0:
        return {"tok_s": 0.0, "input_tok_s": 0.0, "output_tok_s": 0.0, "req_s": 0.0}
    keep = (arrays.t_s >= t0) & (arrays.t_s <= t1)
    input_tok = float(arrays.num_tokens[keep & arrays.is_prefill].sum())
    output_tok = float(arrays.num_tokens[keep & ~arrays.is_prefill].sum())
    num_done = sum(t0 <= f <= t1 for f in finishes)
    return {
        "tok_s": (input_tok + output_tok) / duration,
        "input_tok_s": input_tok / duration,
        "output_tok_s": output_tok / duration,
        "req_s": num_done / duration,
    }


def cache_hit_rate(records: Sequence[RequestRecord]) -> float:
    """``Σ prefix_len / Σ input_len`` over admitted, non-rejected requests; 0.0 if none."""
    admitted = [r for r in records if r.admit_s is not None and not r.rejected]
    total = sum(r.input_len for r in admitted)
    return sum(r.prefix_len for r in admitted) / total if total else 0.0


# --- one row per run ------------------------------------------------------------------------


def summarize(
    events: Sequence[ServiceEvent] | EventArrays,
    records: Sequence[RequestRecord],
    cost: CostFunction | None = None,
    *,
    window_s: float = 60.0,
) -> dict:
    """One JSON-serialisable row of a run's metrics (plain floats, ints and ``None``).

    ``jain`` is over per-client service rates in the active interval (``jain_scope =
    "active"``) or, when there is none, over the whole run (``"run"``; the run spans the
    first arrival/event to the last event). Per-client ``service_rate`` uses the same span.
    """
    arrays = _arrays(events, cost)
    clients = sorted(set(arrays.clients) | {r.client for r in records})
    interval = active_interval(records)
    times = [r.arrival_s for r in records] + arrays.t_s[:1].tolist() + arrays.t_s[-1:].tolist()
    if interval is not None:
        scope, (t0, t1) = "active", interval
        service = per_client_service(arrays, t0=t0, t1=t1)
    else:
        scope, t0, t1 = "run", min(times, default=0.0), max(times, default=0.0)
        service = per_client_service(arrays)
    span = t1 - t0
    rates = {c: service.get(c, 0.0) / span if span > 0 else 0.0 for c in clients}
    total = per_client_service(arrays)
    diff = service_difference(arrays, records, window_s=window_s)
    tput = throughput(records, arrays)
    overall = _latency_row(records)
    program_e2e = program_latency(records)
    programs = percentiles(program_e2e.values())
    latency = per_client_latency(records)
    return {
        "throughput_tok_s": tput["tok_s"],
        "throughput_input_tok_s": tput["input_tok_s"],
        "throughput_output_tok_s": tput["output_tok_s"],
        "throughput_req_s": tput["req_s"],
        "jain": jain_index(rates.values()) if clients else None,
        "jain_scope": scope,
        "active_t0_s": _opt(interval[0]) if interval else None,
        "active_t1_s": _opt(interval[1]) if interval else None,
        "service_diff_max": diff["max"],
        "service_diff_avg": diff["avg"],
        "service_diff_var": diff["var"],
        **overall,
        "program_e2e_p50_s": programs[50],
        "program_e2e_p99_s": programs[99],
        "num_programs_finished": len(program_e2e),
        "cache_hit_rate": float(cache_hit_rate(records)),
        "clients": {
            c: {
                "service": total.get(c, 0.0),
                "service_rate": float(rates[c]),
                **latency.get(c, _latency_row([])),
            }
            for c in clients
        },
    }
