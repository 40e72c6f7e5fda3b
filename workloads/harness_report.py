"""A live run's results in the experiments' terms: the cluster row (``harness_row``), the
per-client fairness table, and the server's own description of itself (``server_info``)
turned into the row's policy label and dp.

The row is computed by the same metrics code as the simulated rows (``metrics.summarize``
over the client's observations, ``program_metrics`` for program latencies), so a live row
compares field by field with a simulated one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sgl_fair import metrics
from sgl_fair.records import QUEUED_S, EventKind

from .combos import label_of
from .harness import HarnessResult
from .loadclient import CallRecord
from .program_metrics import ACTUAL, PERCEIVED, client_latencies, service_series
from .program_metrics import well_behaved_latency_of as _wb_latency
from .programs import Program, ProgramClient

# ---------------------------------------------------------------------------------------------
# Server info


def server_dp_size(info: Mapping[str, Any]) -> int | None:
    dp = info.get("dp_size")
    if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1:
        return dp
    return None


def server_policy(info: Mapping[str, Any]) -> dict[str, Any]:
    """The row's ``policy``/``router``/``local`` (+ opts) from what the server says.

    Our server reports ``router_policy`` and ``schedule_policy`` (the local policy, SGLang's
    flag name) with their ``*_opts``; a plain SGLang server has ``load_balance_method`` (its
    dp router) and ``schedule_policy``. The label is the cluster experiments' for the same
    pairing (e.g. ``D2LPM``), so live and simulated rows line up; else ``router+local``.
    """
    router = info.get("router_policy") or info.get("router") or info.get("load_balance_method")
    local = info.get("schedule_policy") or info.get("local_policy") or info.get("local")
    router = str(router) if router is not None else None
    local = str(local) if local is not None else None
    label = "+".join(x for x in (router, local) if x) or "unknown"
    label = label_of(router, local) or label

    def opts(key: str) -> dict[str, Any]:
        value = info.get(key)
        return dict(value) if isinstance(value, Mapping) else {}

    return {
        "policy": label,
        "router": router,
        "local": local,
        "router_opts": opts("router_policy_opts"),
        "local_opts": opts("schedule_policy_opts"),
    }


# ---------------------------------------------------------------------------------------------
# Rows


def throttle_summary(calls: Sequence[CallRecord], programs: Sequence[Program]) -> dict[str, Any]:
    """FairServe's view of a live run (issue 14's report fields), from what the client saw.

    A call is *throttled* when the server answered 429 saying so (FairServe's OIT; plain
    queue-full or rate-limit 429s are not throttles). An interaction is a program run; its
    *wasted* tokens are the prompt + output tokens of its calls that finished before one of
    its calls was throttled (the work the user never gets an answer from). A user is a
    client; *served* means at least one of its started programs finished. Users throttled
    are split as the workload knows them: *abusive* when any of its programs is a
    misbehaving client's (the S1/S2 scenarios), *benign* otherwise.
    """
    throttled = [
        c
        for c in calls
        if c.state == "failed" and c.status == 429 and "throttled" in (c.error or "")
    ]
    hit = {c.program_id for c in throttled}
    wasted = sum(
        (c.prompt_tokens or c.input_len) + (c.completion_tokens or len(c.output_ids))
        for c in calls
        if c.program_id in hit and c.state == "ok"
    )
    started = [p for p in programs if p.num_issued > 0]
    users = {p.client for p in started}
    served = {p.client for p in started if p.done and not p.failed}
    abusive = {p.client for p in programs if not p.well_behaved}
    throttled_users = {c.client for c in throttled}
    return {
        "calls_throttled": len(throttled),
        "interactions_throttled": len(hit),
        "tokens_wasted": wasted,
        "users_throttled": len(throttled_users),
        "benign_users_throttled": len(throttled_users - abusive),
        "abusive_users_throttled": len(throttled_users & abusive),
        "users_served_pct": 100.0 * len(served) / len(users) if users else None,
    }


def queue_summary(calls: Sequence[CallRecord]) -> dict[str, Any]:
    """Waiting-queue delay as the server reported it (``meta_info.queue_time``) for the calls
    it served: P50/P99 over those calls, and the % of users (clients) with a call that waited
    more than ``QUEUED_S``. All None when the server reported no queue time."""
    timed = [c for c in calls if c.queue_s is not None]
    if not timed:
        return {"queue_delay_p50_s": None, "queue_delay_p99_s": None, "users_queued_pct": None}
    delays = np.array([c.queue_s for c in timed])
    users = {c.client for c in timed}
    queued = {c.client for c in timed if c.queue_s > QUEUED_S}
    return {
        "queue_delay_p50_s": float(np.percentile(delays, 50)),
        "queue_delay_p99_s": float(np.percentile(delays, 99)),
        "users_queued_pct": 100.0 * len(queued) / len(users),
    }


def harness_row(
    result: HarnessResult,
    clients: Sequence[ProgramClient],
    *,
    workload_name: str,
    scenario: str | None,
    dp: int,
    seed: int,
    server_info: Mapping[str, Any] | None = None,
    series: bool = True,
) -> dict[str, Any]:
    """The run as one row with the cluster experiments' fields (``cluster_runs.run_one``):
    the same metrics code over the client's observations, plus what only a live run has
    (failed and unsent calls, the harness's send lag)."""
    info = dict(server_info or {})
    records = result.records()
    events = result.events()
    t_end = result.t_end_s
    perceived = metrics.EventArrays.from_events(events, PERCEIVED)
    summary = metrics.summarize(perceived, records, window_s=max(result.duration_s / 10, 10.0))
    actual = perceived.repriced(ACTUAL)
    interval = metrics.active_interval(records)
    jain_actual = None
    if interval is not None and interval[1] > interval[0]:
        served = metrics.per_client_service(actual, t0=interval[0], t1=interval[1])
        jain_actual = metrics.jain_index(served.get(c.client, 0.0) for c in clients)
    well = {c.client for c in clients if c.well_behaved}
    started = result.started_programs
    done = [p for p in started if p.done and not p.failed]
    sent = result.sent
    lags = [c.send_s - c.arrival_s for c in sent if c.send_s is not None]
    row: dict[str, Any] = {
        **server_policy(info),
        "dp": dp,
        "workload": workload_name,
        "scenario": scenario,
        "x": None,
        **_wb_latency(
            result.latency_programs,
            records,
            well,
            t_end_s=t_end,
            use_ttft=workload_name == "longqa",
        ),
        **summary,
        "jain_actual": jain_actual,
        "misbehaving": sorted(c.client for c in clients if not c.well_behaved),
        "num_programs": len(result.programs),
        "num_programs_started": len(started),
        "num_programs_done": len(done),
        "num_programs_failed": sum(p.failed for p in started),
        "num_calls": len(records),
        "failed_calls": result.count("failed"),
        **throttle_summary(result.calls, result.programs),
        **queue_summary(result.calls),
        "unfinished_calls": result.count("unfinished"),
        "unsent_calls": result.count("unsent"),
        "makespan_s": t_end,
        "throughput_programs_s": len(done) / t_end if t_end > 0 else 0.0,
        "max_send_lag_s": max(lags, default=0.0),
        "max_loop_lag_s": result.max_loop_lag_s,
        "model": info.get("model") or info.get("model_path"),
        "gpu": info.get("gpu"),
        "backend": info.get("backend"),
        "kv_tokens": info.get("max_total_num_tokens"),
        "duration_s": result.duration_s,
        "drain_timeout_s": result.drain_timeout_s,
        "stopped": result.stopped,
        "seed": seed,
    }
    if series:
        row["series"] = service_series(events, records, t_end)
    return row


def fairness_table(
    result: HarnessResult,
    clients: Sequence[ProgramClient],
    *,
    use_ttft: bool = False,
) -> list[dict[str, Any]]:
    """Per client: role, programs and calls, tokens, the service received (client-perceived:
    input + 2 × output tokens, as the experiments' ``jain``) and its share of all service,
    and latency percentiles (program end-to-end; with ``use_ttft`` also the calls' TTFT)."""
    records = result.records()
    events = result.events()
    service = metrics.per_client_service(metrics.EventArrays.from_events(events, PERCEIVED))
    total = sum(service.values())
    programs: dict[str, list[Program]] = defaultdict(list)
    for p in result.started_programs:
        programs[p.client].append(p)
    calls: dict[str, list[CallRecord]] = defaultdict(list)
    for c in result.calls:
        calls[c.client].append(c)
    tokens: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for ev in events:
        t = tokens[ev.client]
        if ev.kind is EventKind.PREFILL:
            t[0] += ev.input_len
            t[2] += ev.input_len - ev.extend_len
        else:
            t[1] += ev.end - ev.start
    program_lat = client_latencies(
        result.latency_programs, records, t_end_s=result.t_end_s, use_ttft=False
    )
    ttft_lat = client_latencies(
        result.latency_programs, records, t_end_s=result.t_end_s, use_ttft=True
    )
    rows = []
    for spec in clients:
        c = spec.client
        progs, cs = programs.get(c, []), calls.get(c, [])
        lat = metrics.percentiles(program_lat.get(c, []))
        row = {
            "client": c,
            "kind": spec.kind,
            "role": "well-behaved" if spec.well_behaved else "misbehaving",
            "programs_started": len(progs),
            "programs_done": sum(p.done and not p.failed for p in progs),
            "programs_failed": sum(p.failed for p in progs),
            "calls_ok": sum(x.state == "ok" for x in cs),
            "calls_failed": sum(x.state == "failed" for x in cs),
            "calls_unfinished": sum(x.state in ("unfinished", "unsent") for x in cs),
            "input_tokens": tokens[c][0],
            "output_tokens": tokens[c][1],
            "cached_tokens": tokens[c][2],
            "service": service.get(c, 0.0),
            "share": service.get(c, 0.0) / total if total > 0 else 0.0,
            "program_p50_s": lat[50],
            "program_p99_s": lat[99],
        }
        if use_ttft:
            q = metrics.percentiles(ttft_lat.get(c, []))
            row["ttft_p50_s"], row["ttft_p99_s"] = q[50], q[99]
        rows.append(row)
    return rows
