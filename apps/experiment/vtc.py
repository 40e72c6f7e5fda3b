"""The VTC paper's §5.2 experiments (Figs. 3-7, 9, 10, 16), on one simulated worker.

Each figure is a workload (client specs), the policies it compares and its claims, run by
``single.run_experiment``. Setup as the paper's: Llama-2-7B on one A10G with a 10,000-token
KV pool, service = input + 2 × output tokens, 60 s windows. ``EXPERIMENTS`` holds them by
name; each is registered in the experiment registry (``registry``) that
``python -m sgl_fair.experiment`` lists and runs.

Length prediction: VTC and LCF run with ``predict="none"`` (the paper's §5.2 figures charge
output as it is produced), named explicitly below; each row and report names the predictor
(``predictor``: ``none``, the paper's ``predict`` — the mean of the last 5 outputs —, the
artifact's ``ema`` — ``pred ← (4·pred + actual)/5``, first request 0 — or ``oracle``).
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_fair.experiment.registry import ExperimentEntry, ExperimentOutput, register
from sgl_fair.experiment.report import write_outputs
from sgl_fair.experiment.show import print_claims, print_table
from sgl_fair.experiment.single import Claim, Experiment, PolicyRun, PolicySpec, run_experiment
from sgl_fair.workloads.arrivals import Constant, LinearRamp, OnOff, Phases, Poisson, per_minute
from sgl_fair.workloads.lengths import Uniform
from sgl_fair.workloads.traces import ClientSpec

# ---------------------------------------------------------------- claim helpers


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def _balanced(
    runs: dict[str, PolicyRun], label: str, a: str, b: str, t0: float, t1: float, tol: float, cost
) -> Claim:
    sa, sb = runs[label].service(a, t0, t1, cost), runs[label].service(b, t0, t1, cost)
    r = _ratio(min(sa, sb), max(sa, sb))
    return Claim(
        f"{label}: {a} and {b} receive equal service in [{t0:.0f}, {t1:.0f}) s "
        f"(min/max >= {1 - tol:.2f})",
        r >= 1 - tol,
        f"{a}={sa:.0f} {b}={sb:.0f} ratio={r:.3f}",
    )


def _unbalanced(
    runs: dict[str, PolicyRun],
    label: str,
    a: str,
    b: str,
    t0: float,
    t1: float,
    factor: float,
    cost,
) -> Claim:
    sa, sb = runs[label].service(a, t0, t1, cost), runs[label].service(b, t0, t1, cost)
    r = _ratio(max(sa, sb), min(sa, sb))
    return Claim(
        f"{label}: service of {a} and {b} in [{t0:.0f}, {t1:.0f}) s differs by >= {factor:.2f}x",
        r >= factor,
        f"{a}={sa:.0f} {b}={sb:.0f} ratio={r:.3f}",
    )


def _diff_smaller(runs: dict[str, PolicyRun], fair: str, unfair: str, factor: float) -> Claim:
    f, u = runs[fair].row["service_diff_max"], runs[unfair].row["service_diff_max"]
    ok = f is not None and u is not None and f * factor <= u
    return Claim(
        f"{fair}'s max service difference is at least {factor:g}x smaller than {unfair}'s",
        ok,
        f"{fair}={f} {unfair}={u}",
    )


def _ttft(runs: dict[str, PolicyRun], label: str, client: str, q: str = "ttft_p99_s") -> float:
    v = runs[label].row["clients"][client][q]
    return float("inf") if v is None else v


# ---------------------------------------------------------------- VTC §5.2 experiments

# Every synthetic VTC experiment: 256 input and 256 output tokens unless stated.
_L = 256


def _overload_clients(_: float) -> list[ClientSpec]:
    return [
        ClientSpec("client1", Constant(per_minute(90)), _L, _L),
        ClientSpec("client2", Constant(per_minute(180)), _L, _L),
    ]


def _overload_claims(exp, runs, dur):
    c = exp.cost
    return [
        _balanced(runs, "VTC", "client1", "client2", 60, dur, 0.05, c),
        _unbalanced(runs, "FCFS", "client1", "client2", 60, dur, 1.5, c),
        _diff_smaller(runs, "VTC", "FCFS", 3),
        Claim(
            "RPM(30) caps throughput below VTC's (fairness by rejection)",
            runs["RPM(30)"].row["throughput_tok_s"] < 0.9 * runs["VTC"].row["throughput_tok_s"],
            f"RPM={runs['RPM(30)'].row['throughput_tok_s']:.0f} "
            f"VTC={runs['VTC'].row['throughput_tok_s']:.0f} tok/s",
        ),
    ]


def _proportional_clients(_: float) -> list[ClientSpec]:
    return [
        ClientSpec("client1", Constant(per_minute(15)), _L, _L),
        ClientSpec("client2", Constant(per_minute(30)), _L, _L),
        ClientSpec("client3", Constant(per_minute(150)), _L, _L),
    ]


def _proportional_claims(exp, runs, dur):
    c = exp.cost
    vtc = runs["VTC"]
    s1, s2, s3 = (vtc.service(k, 60, dur, c) for k in ("client1", "client2", "client3"))
    total = s1 + s2 + s3
    return [
        Claim(
            "VTC: client1 and client2 (under their share) get service in their 1:2 request ratio",
            abs(_ratio(s2, s1) - 2.0) < 0.2,
            f"client2/client1={_ratio(s2, s1):.3f}",
        ),
        Claim(
            "VTC: client3 (over its share) gets the remaining capacity, more than 1/3",
            s3 / total > 1 / 3,
            f"client3 share={s3 / total:.3f}",
        ),
        Claim(
            "VTC serves client1 ahead of client3's backlog (TTFT p99 < 1/5 of FCFS's)",
            _ttft(runs, "VTC", "client1") < _ttft(runs, "FCFS", "client1") / 5,
            f"VTC p99={_ttft(runs, 'VTC', 'client1'):.2f} s, "
            f"FCFS p99={_ttft(runs, 'FCFS', 'client1'):.2f} s",
        ),
    ]


def _onoff_clients(on_rate_per_min: float) -> Callable[[float], list[ClientSpec]]:
    def build(_: float) -> list[ClientSpec]:
        return [
            ClientSpec(
                "client1", OnOff(Constant(per_minute(on_rate_per_min)), on_s=60, off_s=60), _L, _L
            ),
            ClientSpec("client2", Constant(per_minute(120)), _L, _L),
        ]

    return build


def _onoff_under_claims(exp, runs, dur):
    vtc = runs["VTC"].row
    vtc1, fcfs1 = (
        _ttft(runs, "VTC", "client1", "ttft_p50_s"),
        _ttft(runs, "FCFS", "client1", "ttft_p50_s"),
    )
    vtc2 = _ttft(runs, "VTC", "client2", "ttft_p50_s")
    return [
        Claim(
            "VTC serves client1 (under its share while ON) ahead of client2's backlog "
            "(client1's TTFT p50 < 1/3 of client2's)",
            vtc1 < vtc2 / 3,
            f"client1 p50={vtc1:.2f} s, client2 p50={vtc2:.2f} s",
        ),
        Claim(
            "FCFS makes client1 wait behind client2's backlog (TTFT p50 > 2x VTC's)",
            fcfs1 > 2 * vtc1,
            f"FCFS p50={fcfs1:.2f} s, VTC p50={vtc1:.2f} s",
        ),
        Claim(
            "VTC is work-conserving: throughput within 5% of FCFS",
            vtc["throughput_tok_s"] >= 0.95 * runs["FCFS"].row["throughput_tok_s"],
            f"VTC={vtc['throughput_tok_s']:.0f} FCFS={runs['FCFS'].row['throughput_tok_s']:.0f}",
        ),
    ]


def _onoff_over_claims(exp, runs, dur):
    c = exp.cost
    return [
        _balanced(runs, "VTC", "client1", "client2", 60, dur, 0.1, c),
        _diff_smaller(runs, "VTC", "FCFS", 2),
    ]


def _short_long_clients(_: float) -> list[ClientSpec]:
    return [
        ClientSpec("client1", Poisson(per_minute(240)), Uniform(64, 192), Uniform(64, 192)),
        ClientSpec("client2", Poisson(per_minute(36)), Uniform(384, 640), Uniform(384, 640)),
    ]


def _short_long_claims(exp, runs, dur):
    c = exp.cost
    return [
        _balanced(runs, "VTC", "client1", "client2", 60, dur, 0.1, c),
        _unbalanced(runs, "FCFS", "client1", "client2", 60, dur, 1.2, c),
    ]


def _increase_clients(duration_s: float) -> list[ClientSpec]:
    return [
        ClientSpec("client1", Constant(per_minute(30)), _L, _L),
        ClientSpec("client2", LinearRamp(per_minute(30), per_minute(240)), _L, _L),
    ]


def _mean_ttft(run: PolicyRun, client: str, t0: float, t1: float) -> float:
    """Mean TTFT of ``client``'s requests arriving in [t0, t1); unserved ones count their wait."""
    t_end = run.result.t_end_s
    waits = [
        (r.ttft_s if r.ttft_s is not None else t_end - r.arrival_s)
        for r in run.records
        if r.client == client and t0 <= r.arrival_s < t1 and not r.rejected
    ]
    return sum(waits) / len(waits) if waits else float("nan")


def _increase_claims(exp, runs, dur):
    third = dur / 3
    for label in ("VTC", "FCFS"):
        early = _mean_ttft(runs[label], "client1", 0, third)
        late = _mean_ttft(runs[label], "client1", 2 * third, dur)
        runs[label].row.setdefault("notes", {})["client1_ttft_first_last_third_s"] = [early, late]
    v_early, v_late = runs["VTC"].row["notes"]["client1_ttft_first_last_third_s"]
    f_early, f_late = runs["FCFS"].row["notes"]["client1_ttft_first_last_third_s"]
    return [
        Claim(
            "VTC isolates client1 from client2's ramp: its mean TTFT in the last third stays "
            "within 2 s of the first third",
            v_late - v_early < 2.0,
            f"first third {v_early:.2f} s, last third {v_late:.2f} s",
        ),
        Claim(
            "FCFS does not: client1's mean TTFT in the last third is > 5x VTC's",
            f_late > 5 * v_late,
            f"FCFS {f_late:.2f} s (first third {f_early:.2f} s), VTC {v_late:.2f} s",
        ),
    ]


def _dist_shift_clients(duration_s: float) -> list[ClientSpec]:
    third = duration_s / 3
    client1 = Phases(
        (
            (third, OnOff(Constant(per_minute(30)), on_s=third / 5, off_s=third / 5)),
            (third, Constant(per_minute(120))),
            (third, Constant(per_minute(30))),
        )
    )
    return [
        ClientSpec("client1", client1, _L, _L),
        ClientSpec("client2", Constant(per_minute(120)), _L, _L),
    ]


def _dist_shift_claims(exp, runs, dur):
    c = exp.cost
    third = dur / 3
    # Phase 2 (both over their share); skip its first fifth while queues re-form.
    t0, t1 = third + third / 5, 2 * third
    return [
        _balanced(runs, "VTC", "client1", "client2", t0, t1, 0.1, c),
        _unbalanced(runs, "LCF", "client1", "client2", t0, t1, 1.5, c),
    ]


def _weighted_clients(_: float) -> list[ClientSpec]:
    return [
        ClientSpec(f"client{i}", Constant(per_minute(90)), _L, _L, weight=float(i))
        for i in range(1, 5)
    ]


def _weighted_claims(exp, runs, dur):
    c = exp.cost
    out = []
    for label, expect_weighted in (("VTC", False), ("VTC-weighted", True)):
        s = [runs[label].service(f"client{i}", 60, dur, c) for i in range(1, 5)]
        ratios = [x / s[0] for x in s]
        target = [1.0, 2.0, 3.0, 4.0] if expect_weighted else [1.0] * 4
        err = max(abs(r - t) / t for r, t in zip(ratios, target, strict=True))
        out.append(
            Claim(
                f"{label}: service splits {':'.join(f'{t:g}' for t in target)} (within 15%)",
                err <= 0.15,
                "ratios=" + ":".join(f"{r:.2f}" for r in ratios),
            )
        )
    return out


_NO_PREDICTION = {"predict": "none"}
_BASE = (
    PolicySpec("FCFS", "fcfs"),
    PolicySpec("LCF", "lcf", _NO_PREDICTION),
    PolicySpec("VTC", "vtc", _NO_PREDICTION),
)

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            "vtc-overload",
            "VTC Fig. 3",
            "Two clients at 90 and 180 req/min (256/256 tokens), both over their share.",
            _overload_clients,
            600,
            180,
            (*_BASE, PolicySpec("RPM(30)", "rpm", {"limit": 30})),
            _overload_claims,
        ),
        Experiment(
            "vtc-proportional",
            "VTC Fig. 4",
            "Three clients at 15, 30 and 150 req/min: two under their share, one far over.",
            _proportional_clients,
            600,
            180,
            _BASE,
            _proportional_claims,
        ),
        Experiment(
            "vtc-onoff-under",
            "VTC Fig. 5",
            "client1 ON/OFF (60 s each) at 30 req/min, under its share; client2 at 120 req/min.",
            _onoff_clients(30),
            600,
            240,
            _BASE,
            _onoff_under_claims,
        ),
        Experiment(
            "vtc-onoff-over",
            "VTC Fig. 6",
            "client1 ON/OFF at 120 req/min, backlogged even when OFF; client2 at 120 req/min.",
            _onoff_clients(120),
            600,
            240,
            _BASE,
            _onoff_over_claims,
        ),
        Experiment(
            "vtc-poisson-short-long",
            "VTC Fig. 7",
            "Poisson arrivals: client1 240 req/min of short requests (64-192 tokens), "
            "client2 36 req/min of long ones (384-640); both over their share, client1 more so.",
            _short_long_clients,
            600,
            180,
            _BASE,
            _short_long_claims,
        ),
        Experiment(
            "vtc-increase",
            "VTC Fig. 9",
            "client1 at 30 req/min; client2 ramps linearly from 30 to 240 req/min.",
            _increase_clients,
            600,
            180,
            _BASE,
            _increase_claims,
        ),
        Experiment(
            "vtc-dist-shift",
            "VTC Fig. 10",
            "Three phases: client1 ON/OFF under its share, then over it at 120 req/min, then "
            "under again at 30; client2 at 120 req/min throughout.",
            _dist_shift_clients,
            900,
            300,
            _BASE,
            _dist_shift_claims,
        ),
        Experiment(
            "vtc-weighted",
            "VTC Fig. 16",
            "Four clients at 90 req/min each with weights 1, 2, 3, 4: VTC vs weighted VTC.",
            _weighted_clients,
            600,
            180,
            (
                PolicySpec("VTC", "vtc", _NO_PREDICTION),
                PolicySpec("VTC-weighted", "vtc", _NO_PREDICTION, weighted=True),
            ),
            _weighted_claims,
        ),
    )
}


def get_experiment(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ValueError(
            f"unknown experiment {name!r}; choose one of: {', '.join(EXPERIMENTS)}"
        ) from None


# ---------------------------------------------------------------- registry


def _show(result: ExperimentOutput, paths: dict) -> None:
    exp = result.experiment
    print_table(f"{exp.name} ({exp.figure}) — {exp.description}", result.rows)
    named = [f"{r['policy']}: {r['predictor']}" for r in result.rows if "predictor" in r]
    if named:
        print("  output-length predictor (VTC's predict): " + ", ".join(named))
    print_claims(result.claims)
    print(f"report: {paths['report']}  (results.json and plots alongside)")


def _entry(exp: Experiment) -> ExperimentEntry:
    return ExperimentEntry(
        exp.name,
        exp.figure,
        exp.description,
        run=lambda o: run_experiment(exp, quick=o.quick, seed=o.seed),
        quick={"duration_s": exp.quick_duration_s},
        write=write_outputs,
        show=_show,
    )


for _exp in EXPERIMENTS.values():
    register(_entry(_exp), family=__name__)
