"""``d2lpm-replicas`` (issue 34): D2LPM with R router replicas behind a load balancer.

The d2lpm-quantum setting (4 × A100-80GB, Llama-3.1-8B, ToT with the paper's misbehaver,
D2LPM+DLPM at the defaults; S1 and S2), routed by

* one router (``replicas`` 1, ``shared_state`` None: the plain ``Router``);
* R replicas sharing the workers' service reports every ``report_period_s`` (``shared_state``
  True; R = 1 must reproduce one router exactly);
* R independent replicas (``shared_state`` False: today's router behind a load balancer).

Full: R = 1, 2, 4, 8 × reports every 10, 100, 500 ms, 120 s of arrivals. Quick: 30 s of
arrivals, the periods at R = 4 and R = 2, 8 at 100 ms. Both: R = 4 at 100 ms with a fault
injected halfway through the arrivals (issue 40; ``FAULT_ROWS``, ``cluster_fault_sim.py``):
a worker restart with the same pid, a 7 s partition of one worker from one replica, a replica
restart, duplicate rids. Fault rows carry ``fault`` (absent on the others) and the calls'
outcomes: ``calls_lost`` and ``calls_hung`` must be 0, Jain within 0.03 of the fault-free row.

The load balancer round-robins calls over the replicas, so each replica sees every client
(``cluster_replica_set.py``; ``docs/replicas.md``). Rows carry ``replicas``,
``report_period_s``, ``shared_state``, ``setup``, the misbehaver's share of the service
(``misbehaver_share``) and the replicas' staleness in service units (``view_lag_max``: the
most of a client's service on one worker a replica had not yet seen when it dispatched;
``spread_max``: the most a client's service on one worker ran ahead of its least-charged one).
"""

from __future__ import annotations

from sgl_fair.workloads.combos import D2LPM

from .cluster_base import RATE_SCALE, ClusterExperiment, claim, missing, one
from .cluster_replica_faults import FAULTS
from .cluster_runs import RunSpec

PERIODS = (0.01, 0.1, 0.5)
REPLICAS = (2, 4, 8)
TARGET_R, TARGET_PERIOD = 4, 0.1
SERVED = "served_tok_s"  # tokens served while programs arrive (the grid's throughput)
FAULT_ROWS = FAULTS  # each at TARGET_R, TARGET_PERIOD
FAULT_JAIN = 0.03  # a fault row's Jain may fall this far below the fault-free row's
# Fields that must match exactly between one router and one replica with shared state.
_EXACT = (
    "served_tok_s",
    "throughput_tok_s",
    "jain",
    "cache_hit_rate",
    "p99_well_behaved_s",
    "dispatch_counts",
    "makespan_s",
    "num_retractions",
    "clients",
)


def _specs(quick: bool, seed: int) -> list[RunSpec]:
    scenarios = ("s1", "s2")
    dur = 30.0 if quick else 120.0
    specs = []
    for sc in scenarios:
        base = RunSpec(D2LPM, 4, "tot", sc, dur, rate_scale=RATE_SCALE["tot", sc], seed=seed)
        specs.append(
            base.replace(
                row_extra={
                    "replicas": 1,
                    "report_period_s": None,
                    "shared_state": None,
                    "setup": "one router",
                }
            )
        )
        shared = [(1, TARGET_PERIOD)]
        for r in REPLICAS:
            for p in PERIODS:
                if not quick or r == TARGET_R or p == TARGET_PERIOD:
                    shared.append((r, p))
        for r, p in shared:
            specs.append(
                base.replace(
                    replicas=r, report_period_s=p, x=float(r), row_extra={"setup": "shared"}
                )
            )
        for r in REPLICAS:
            specs.append(
                base.replace(
                    replicas=r, shared_state=False, x=float(r), row_extra={"setup": "independent"}
                )
            )
        for fault in FAULT_ROWS:
            specs.append(
                base.replace(
                    replicas=TARGET_R,
                    report_period_s=TARGET_PERIOD,
                    x=float(TARGET_R),
                    fault=fault,
                    row_extra={"setup": "fault"},
                )
            )
    return specs


def _claims(rows):
    claims = []
    for sc in sorted({r["scenario"] for r in rows}):
        cell = [r for r in rows if r["scenario"] == sc]
        claims += _scenario_claims(sc, cell)
    return claims


def _scenario_claims(sc: str, rows):
    tag = f"ToT-{sc.upper()}:"
    base = one(rows, setup="one router")
    r1 = one(rows, setup="shared", replicas=1)
    tgt = one(rows, setup="shared", replicas=TARGET_R, report_period_s=TARGET_PERIOD)
    ind = one(rows, setup="independent", replicas=TARGET_R)
    out = []
    text = f"{tag} one replica with shared state reproduces one router exactly"
    if base is None or r1 is None:
        out.append(missing(text))
    else:
        diff = [k for k in _EXACT if base.get(k) != r1.get(k)]
        out.append(claim(text, not diff, "differ: " + (", ".join(diff) or "nothing")))
    what = f"R = {TARGET_R}, {TARGET_PERIOD * 1000:g} ms reports"
    if base is None or tgt is None:
        return out + [missing(f"{tag} {what}: the targets")] + _fault_claims(tag, tgt, rows)
    ratio = tgt[SERVED] / base[SERVED]
    out.append(
        claim(
            f"{tag} {what}: throughput ≥ 0.95× one router's",
            ratio >= 0.95,
            f"{ratio:.3f}× ({tgt[SERVED]:.0f} vs {base[SERVED]:.0f} tok/s)",
        )
    )
    d_jain = tgt["jain"] - base["jain"]
    out.append(
        claim(
            f"{tag} {what}: Jain ≥ one router's − 0.02",
            d_jain >= -0.02,
            f"{tgt['jain']:.3f} vs {base['jain']:.3f} ({d_jain:+.3f})",
        )
    )
    share = tgt.get("misbehaver_share")
    base_share = base.get("misbehaver_share")
    if share is not None and base_share is not None:
        d = share - base_share
        out.append(
            claim(
                f"{tag} {what}: the misbehaver's share within 5 points of one router's",
                abs(d) <= 0.05,
                f"{share:.3f} vs {base_share:.3f} ({d * 100:+.1f} points)",
            )
        )
    if ind is not None:
        out.append(
            claim(
                f"{tag} R = {TARGET_R}: shared state serves ≥ independent replicas",
                tgt[SERVED] >= ind[SERVED],
                f"{tgt[SERVED]:.0f} vs {ind[SERVED]:.0f} tok/s; cache hit "
                f"{tgt['cache_hit_rate']:.3f} vs {ind['cache_hit_rate']:.3f}",
            )
        )
    lags = sorted(
        (r for r in rows if r["setup"] == "shared" and r["replicas"] == TARGET_R),
        key=lambda r: r["report_period_s"],
    )
    if len(lags) >= 2:
        lo, hi = lags[0], lags[-1]
        out.append(
            claim(
                f"{tag} R = {TARGET_R}: a replica's view lags more with a longer period",
                hi["view_lag_max"] >= lo["view_lag_max"],
                f"{lo['report_period_s'] * 1000:g} ms: {lo['view_lag_max']:.0f}, "
                f"{hi['report_period_s'] * 1000:g} ms: {hi['view_lag_max']:.0f} "
                "service units",
            )
        )
    return out + _fault_claims(tag, tgt, rows)


def _fault_claims(tag: str, tgt: dict | None, rows) -> list:
    """Each fault row against the fault-free run at the same R and period (``tgt``)."""
    out = []
    for fault in FAULT_ROWS:
        row = None if tgt is None else one(rows, setup="fault", fault=fault)
        what = f"{tag} {fault} at R = {TARGET_R}, {TARGET_PERIOD * 1000:g} ms"
        texts = (
            f"{what}: 0 calls lost or hung, none left in flight",
            f"{what}: Jain ≥ the fault-free run's − {FAULT_JAIN:g}",
        )
        if row is None:
            out += [missing(text) for text in texts]
            continue
        bad = {k: row[k] for k in ("calls_lost", "calls_hung", "inflight_leaked") if row[k]}
        ref = tgt.get("unfinished_calls", 0)
        detail = ", ".join(f"{k} {v}" for k, v in bad.items()) or "none lost, hung or in flight"
        detail += f" (the fault-free run left {ref} calls unfinished)"
        moved = ", ".join(f"{k} {row[k]}" for k in _OUTCOMES if row.get(k))
        out.append(
            claim(
                texts[0],
                not bad and ref == 0,
                detail + (f"; {moved}" if moved else ""),
            )
        )
        d_jain = row["jain"] - tgt["jain"]
        out.append(
            claim(
                texts[1],
                d_jain >= -FAULT_JAIN,
                f"{row['jain']:.3f} vs {tgt['jain']:.3f} ({d_jain:+.3f})",
            )
        )
    return out


_OUTCOMES = ("calls_failed", "calls_redispatched", "calls_retried", "calls_refused")


REPLICAS_EXP = ClusterExperiment(
    "d2lpm-replicas",
    "issue 34",
    "4 × A100-80GB, ToT S1/S2: D2LPM with R = 1–8 router replicas sharing the workers' "
    "service reports every 10–500 ms, against one router and R independent replicas",
    _specs,
    _claims,
    x_label="router replicas",
)
