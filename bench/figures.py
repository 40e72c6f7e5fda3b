"""The headline figures: which stored result each comes from, its target, and where the
README quotes it. ``bench/report.py`` reads this and ``bench/results/*.json``.

A figure is ``Figure(key, name, files, value, ...)``:

* ``files``: a glob under ``bench/results/``; the newest match (by its date, then its name)
  is the source;
* ``value``: a path into the file's JSON — keys joined by ``.``, ``[k=v,k2=v2]`` picks the one
  list element whose fields equal those values (numbers compare as numbers), ``[3]`` an
  index — or a pair of paths ``(numerator, denominator)`` for a ratio of two;
* ``target``: ``(op, bound)`` with op ``<=`` or ``>=``: the status is *pass* or *missed*;
* ``claim``: text found in one of the file's ``claims``: the status is the claim's own,
  *pass* or *FAIL* (a claim that fails is printed as failing, never dropped);
* ``fmt`` and ``unit``: how the value is printed (the README quotes that string).

``STORED`` gives the date, commit and machine of the older files written before the
stored-results envelope (``sgl-fair/results/1``), as their BENCHMARKS.md sections state them.

``README_QUOTES``: the README's sentences that quote figures, with ``{key}`` where a figure's
value (with its unit) goes and ``{key/n}`` for its number alone; the docs test fails when the
README does not contain them with the current values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EPYC = "AMD EPYC, 2 cores (shared), Python 3.11.7"


@dataclass(frozen=True)
class Figure:
    key: str
    name: str
    files: str
    value: Any  # a path, or (numerator path, denominator path)
    fmt: str = "{:.2f}"
    unit: str = ""
    target: tuple[str, float] | None = None
    claim: str | None = None


_SBS = "side-by-side-2*.json"  # 2 running per server, flood 24, 30 s (the default setting)
_SBS4 = "side-by-side-r4f16-*.json"  # 4 running per server, flood 16, 40 s
_KV = "kv-decoder-*-after.json"
_ADM = "sglang-live-admission-*-after-churn.json"
_ADM_FV = "sglang-live-admission-*-after-churn*.json"  # also the runs of fcfs and vtc alone
_BICACHE = "bros-bicache-20*.json"
_BICACHE_Q = "bros-bicache-quick-*.json"
_BICACHE_R = "bros-bicache-rate-*.json"
_TTFT = "TTFT attainment with Bi-cache >= 1.15x No Bi-cache (paged-recompute; paper, BE batch {b},"
_TPOT = (
    "TPOT (per-token) attainment with Bi-cache >= 1.15x No Bi-cache (paged-recompute; "
    "paper, BE batch {b},"
)
_GAIN = "gains[setting=paper,be_batch={b},rate=10].vs_paged-recompute.rt_ttft_attain"


_FS = "fairserve-apps-20*.json"
_TPOT_GAIN = _GAIN.replace("rt_ttft", "rt_tpot_token")
# the same against No Bi-cache on vLLM's engine rules (the arm paged-recompute-vllm)
_GAIN_V = _GAIN.replace("vs_paged-recompute.", "vs_paged-recompute-vllm.")
_TPOT_GAIN_V = _TPOT_GAIN.replace("vs_paged-recompute.", "vs_paged-recompute-vllm.")
_TTFT_V = _TTFT.replace("(paged-recompute;", "(paged-recompute-vllm;")
_TPOT_V = _TPOT.replace("(paged-recompute; ", "(paged-recompute-vllm; ")


_REP = "d2lpm-replicas-quick-*.json"
_LEDGER = "replica-ledger-*-after.json"


def _rep(scenario: str, setup: str, replicas: int, period: float | None) -> str:
    period_s = "None" if period is None else period
    return (f"rows[scenario={scenario},setup={setup},replicas={replicas},"
            f"report_period_s={period_s}].served_tok_s")  # fmt: skip


def _ledger(clients: int, field: str) -> str:
    return f"rows[clients_seen={clients}].{field}"


def _fs(policy: str, field: str) -> str:
    return f"rows[scenario=paper,policy={policy}].{field}"


def _adm(case: str, ref: str, waiting: str) -> tuple[str, str]:
    return (f"[case={case}].~{waiting}.p50_ms", f"[case={ref}].~{waiting}.p50_ms")


def _side_by_side(key: str, files: str, setting: str) -> list[Figure]:
    name = f"Side by side ({setting}): "
    return [
        Figure(f"{key}-tokens", name + "tokens served, ours ÷ SGLang's stack", files,
               "ratios.ours.tokens", unit="×", target=(">=", 0.95)),
        Figure(f"{key}-relay-cpu", name + "relay CPU per streamed token, ours ÷ gateway", files,
               "ratios.ours.relay_cpu_per_token", unit="×", target=("<=", 2.0)),
        Figure(f"{key}-victim-p99", name + "victim TTFT P99, ours ÷ SGLang's stack", files,
               "ratios.ours.victim_ttft_p99", fmt="{:.1f}", unit="×", target=("<=", 0.5)),
        Figure(f"{key}-victim-p90", name + "victim TTFT P90, ours ÷ SGLang's stack", files,
               "ratios.ours.victim_ttft_p90", unit="×"),
        Figure(f"{key}-victim-p50", name + "victim TTFT P50, ours ÷ SGLang's stack", files,
               ("ours.tenants.victim.ttft_p50_s", "sglang.tenants.victim.ttft_p50_s"),
               unit="×"),
        Figure(f"{key}-victim-tokens", name + "victim's tokens served, ours ÷ SGLang's stack",
               files, "ratios.ours.victim_tokens", unit="×"),
    ]  # fmt: skip


FIGURES: list[Figure] = [
    *(fig for key, files, setting in (("sbs", _SBS, "2 running/server, flood 24"),
                                       ("sbs4", _SBS4, "4 running/server, flood 16"))
      for fig in _side_by_side(key, files, setting)),
    Figure("relay-standin", "Relay over stand-in SGLang servers (bench_relay.py): CPU per "
           "streamed token, ours ÷ gateway", "relay-2*.json", "ratios.ours.relay_cpu_per_token",
           unit="×", target=("<=", 2.0)),
    Figure("kv-gc", "KV decoder: full gc.collect() with 1M cached tokens", _KV,
           "gc_collect_ms", fmt="{:.1f}", unit=" ms", target=("<=", 20.0)),
    Figure("kv-bytes", "KV decoder: memory per cached token", _KV,
           "bytes_per_token", fmt="{:.0f}", unit=" B", target=("<=", 32.0)),
    Figure("kv-follow-depth-leaf", "KV events followed (decoder + tree, what the router and the "
           "plugin run): store cost at 32k ÷ 1k-token prefix (leaf)", _KV,
           "follow_ratio_32k_1k.store_leaf_us", fmt="{:.2f}", unit="×", target=("<=", 1.5)),
    Figure("kv-follow-depth-mid", "… (mid-chain)", _KV,
           "follow_ratio_32k_1k.store_mid_us", fmt="{:.2f}", unit="×", target=("<=", 1.5)),
    Figure("kv-depth-leaf", "KV decoder's apply() alone, each op with its whole path (before "
           "d84bd9e the router's way): store at 32k ÷ 1k (leaf)", _KV,
           "store_leaf_ratio_32k_1k", fmt="{:.1f}", unit="×"),
    Figure("kv-depth-mid", "… (mid-chain)", _KV,
           "store_mid_ratio_32k_1k", fmt="{:.1f}", unit="×"),
    Figure("adm-fcfs-128", "Plugin pass in live SGLang, churn, ~128 waiting: fcfs ÷ SGLang fcfs",
           _ADM_FV, _adm("plugin:fcfs", "sglang:fcfs", "128"), unit="×", target=("<=", 1.2)),
    Figure("adm-vtc-128", "Plugin pass in live SGLang, churn, ~128 waiting: vtc ÷ SGLang fcfs",
           _ADM_FV, _adm("plugin:vtc", "sglang:fcfs", "128"), unit="×", target=("<=", 1.2)),
    Figure("adm-dlpm-128", "Plugin pass in live SGLang, churn, ~128 waiting: dlpm ÷ SGLang lpm",
           _ADM, _adm("plugin:dlpm", "sglang:lpm", "128"), unit="×", target=("<=", 1.5)),
    Figure("adm-fcfs-1000",
           "Plugin pass in live SGLang, churn, ~1,000 waiting: fcfs ÷ SGLang fcfs",
           _ADM_FV, _adm("plugin:fcfs", "sglang:fcfs", "1000"), unit="×", target=("<=", 1.2)),
    Figure("adm-vtc-1000", "Plugin pass in live SGLang, churn, ~1,000 waiting: vtc ÷ SGLang fcfs",
           _ADM_FV, _adm("plugin:vtc", "sglang:fcfs", "1000"), unit="×", target=("<=", 1.2)),
    Figure("adm-dlpm-1000",
           "Plugin pass in live SGLang, churn, ~1,000 waiting: dlpm ÷ SGLang lpm",
           _ADM, _adm("plugin:dlpm", "sglang:lpm", "1000"), unit="×", target=("<=", 1.5)),
    Figure("bicache-rate-ttft-32",
           "bros-bicache, paper's setting, 10 RT req/s, 60 s: TTFT attainment ÷ No Bi-cache, "
           "BE batch 32", _BICACHE_R, _GAIN.format(b=32), unit="×", claim=_TTFT.format(b=32)),
    Figure("bicache-rate-ttft-256", "… BE batch 256", _BICACHE_R, _GAIN.format(b=256),
           unit="×", claim=_TTFT.format(b=256)),
    Figure("bicache-rate-ttft-512", "… BE batch 512", _BICACHE_R, _GAIN.format(b=512),
           unit="×", claim=_TTFT.format(b=512)),
    Figure("bicache-rate-tpot-32", "… TPOT (per-token) attainment ÷ No Bi-cache, BE batch 32",
           _BICACHE_R, _TPOT_GAIN.format(b=32), unit="×", claim=_TPOT.format(b=32)),
    Figure("bicache-rate-tpot-512", "… TPOT (per-token) attainment ÷ No Bi-cache, BE batch 512",
           _BICACHE_R, _TPOT_GAIN.format(b=512), unit="×", claim=_TPOT.format(b=512)),
    Figure("bicache-vllm-ttft-32",
           "bros-bicache, paper's setting, 10 RT req/s, 60 s: TTFT attainment ÷ No Bi-cache on "
           "vLLM's engine rules (paged-recompute-vllm), BE batch 32", _BICACHE_R,
           _GAIN_V.format(b=32), unit="×", claim=_TTFT_V.format(b=32)),
    Figure("bicache-vllm-ttft-256", "… BE batch 256", _BICACHE_R, _GAIN_V.format(b=256),
           unit="×", claim=_TTFT_V.format(b=256)),
    Figure("bicache-vllm-ttft-512", "… BE batch 512", _BICACHE_R, _GAIN_V.format(b=512),
           unit="×", claim=_TTFT_V.format(b=512)),
    Figure("bicache-vllm-tpot-32",
           "… TPOT (per-token) attainment ÷ No Bi-cache on vLLM's rules, BE batch 32",
           _BICACHE_R, _TPOT_GAIN_V.format(b=32), unit="×", claim=_TPOT_V.format(b=32)),
    Figure("bicache-vllm-tpot-512", "… TPOT (per-token) attainment ÷ No Bi-cache on vLLM's "
           "rules, BE batch 512", _BICACHE_R, _TPOT_GAIN_V.format(b=512), unit="×",
           claim=_TPOT_V.format(b=512)),
    Figure("bicache-ttft-32",
           "bros-bicache, whole sweep (before the allocator fix aa3d085), 10 RT req/s: TTFT "
           "attainment ÷ No Bi-cache, BE batch 32", _BICACHE, _GAIN.format(b=32), unit="×",
           claim=_TTFT.format(b=32)),
    Figure("bicache-ttft-256", "… BE batch 256", _BICACHE, _GAIN.format(b=256), unit="×",
           claim=_TTFT.format(b=256)),
    Figure("bicache-ttft-512", "… BE batch 512", _BICACHE, _GAIN.format(b=512), unit="×",
           claim=_TTFT.format(b=512)),
    Figure("bicache-quick-ttft-32",
           "bros-bicache --quick (15 s), 10 RT req/s: TTFT attainment ÷ No Bi-cache, BE batch "
           "32", _BICACHE_Q, _GAIN.format(b=32), unit="×", claim=_TTFT.format(b=32)),
    Figure("bicache-quick-ttft-256", "… BE batch 256", _BICACHE_Q, _GAIN.format(b=256),
           unit="×", claim=_TTFT.format(b=256)),
    Figure("bicache-quick-ttft-512", "… BE batch 512", _BICACHE_Q, _GAIN.format(b=512),
           unit="×", claim=_TTFT.format(b=512)),
    Figure("fs-wasted-rpm", "fairserve-apps (paper scenario, full): tokens wasted by rpm", _FS,
           _fs("rpm", "tokens_wasted"), fmt="{:.0f}"),
    Figure("fs-wasted", "… tokens wasted by fairserve", _FS, _fs("fairserve", "tokens_wasted"),
           fmt="{:.0f}", claim="paper: fairserve wastes 0 tokens"),
    Figure("fs-rpm-benign-users", "… benign users throttled by rpm", _FS,
           _fs("rpm", "benign_users_throttled"), fmt="{:.0f}"),
    Figure("fs-benign-users", "… benign users throttled by fairserve", _FS,
           _fs("fairserve", "benign_users_throttled"), fmt="{:.0f}",
           claim="paper: no benign user throttled"),
    Figure("fs-queued", "… users queued, fairserve", _FS, _fs("fairserve", "users_queued_pct"),
           fmt="{:.1f}", unit=" %", claim="paper: users seeing queueing delay <= 1/5"),
    Figure("fs-queued-vtc", "… users queued, vtc", _FS, _fs("vtc", "users_queued_pct"),
           fmt="{:.1f}", unit=" %"),
    Figure("fs-overloaded", "… throughput while overloaded, fairserve ÷ vtc", _FS,
           (_fs("fairserve", "served_overloaded_tok_s"), _fs("vtc", "served_overloaded_tok_s")),
           unit="×", claim="paper: throughput while overloaded >= vtc's"),
    Figure("fs-throughput", "… throughput over the whole run, fairserve ÷ vtc", _FS,
           (_fs("fairserve", "throughput_tok_s"), _fs("vtc", "throughput_tok_s")),
           unit="×", claim="paper: throughput >= vtc's"),
    Figure("fs-interactions", "… interactions throttled, rpm ÷ fairserve", _FS,
           (_fs("rpm", "interactions_throttled"), _fs("fairserve", "interactions_throttled")),
           unit="×", claim="paper: fairserve throttles >= 10x fewer interactions"),
    Figure("sim-speed-min", "Simulator speed, vtc-overload full length, slowest policy",
           "sim-speed-*.json", "min_speedup", fmt="{:.0f}", unit="× real time",
           target=(">=", 100.0)),
    Figure("sim-speed-max", "… fastest policy", "sim-speed-*.json", "max_speedup",
           fmt="{:.0f}", unit="× real time"),
    Figure("replicas-s2-r4", "d2lpm-replicas --quick, S2, R = 4, 100 ms reports: served ÷ one "
           "router", _REP, (_rep("s2", "shared", 4, 0.1), _rep("s2", "one router", 1, None)),
           fmt="{:.3f}", unit="×", claim="ToT-S2: R = 4, 100 ms reports: throughput"),
    Figure("replicas-s2-r4-indep", "… R = 4 independent replicas: served ÷ one router", _REP,
           (_rep("s2", "independent", 4, None), _rep("s2", "one router", 1, None)),
           fmt="{:.3f}", unit="×"),
    Figure("ledger-bytes", "Replica ledger, 100,000 one-shot clients, R = 4: mean bytes per "
           "report (rows)", _LEDGER, _ledger(100000, "mean_bytes_last_10"), fmt="{:,.0f}",
           unit=" B"),
    Figure("ledger-bytes-flat", "… mean bytes per report at 100,000 ÷ at 10,000 clients",
           _LEDGER, (_ledger(100000, "mean_bytes_last_10"), _ledger(10000, "mean_bytes_last_10")),
           unit="×", target=("<=", 1.5)),
    Figure("ledger-bytes-before", "… before, totals per client (2026-11-27's ledger)",
           "replica-ledger-*-before.json", _ledger(100000, "mean_bytes_last_10"),
           fmt="{:,.0f}", unit=" B"),
]  # fmt: skip

STORED: dict[str, dict[str, str]] = {
    "side-by-side-2026-11-28-final.json": {"commit": "5ae5b6a", "machine": EPYC},
    "kv-decoder-2026-11-28-after.json": {"commit": "c24b290", "machine": EPYC},
    "kv-decoder-2026-11-28-before.json": {"commit": "4a8c20c", "machine": EPYC},
    "sglang-live-admission-2026-11-28-after-churn.json": {
        "commit": "2f08347 (dirty)",
        "machine": EPYC,
    },
    "sglang-live-admission-2026-11-28-after.json": {"commit": "2f08347 (dirty)", "machine": EPYC},
    "bros-bicache-2026-11-27.json": {"commit": "c353086 (stored)", "machine": EPYC},
    "replica-ledger-2026-11-29-after.json": {"commit": "37290c5", "machine": EPYC},
    "sglang-live-admission-2026-11-29-after-churn.json": {"commit": "a296f23", "machine": EPYC},
    "replica-ledger-2026-11-29-before.json": {"commit": "08cd15f", "machine": EPYC},
    "side-by-side-2026-11-29.json": {"commit": "c6b1bd7", "machine": EPYC},
    "side-by-side-2026-11-29b.json": {"commit": "392194c", "machine": EPYC},
    "side-by-side-r4f16-2026-11-29.json": {"commit": "392194c", "machine": EPYC},
    "side-by-side-r4f16-2026-11-29b.json": {"commit": "836a082", "machine": EPYC},
    "side-by-side-2026-11-29c.json": {"commit": "2ab9411", "machine": EPYC},
    "side-by-side-r4f16-2026-11-29c.json": {"commit": "2ab9411", "machine": EPYC},
    "kv-decoder-2026-11-29-after.json": {"commit": "eae2e42", "machine": EPYC},
    "kv-decoder-2026-11-29b-after.json": {"commit": "7366c7c", "machine": EPYC},
    "sglang-live-admission-2026-11-29b-after-churn.json": {"commit": "50944a7", "machine": EPYC},
    "sglang-live-admission-2026-11-29c-after-churn-fcfs-vtc.json": {
        "commit": "aa7b76a",
        "machine": EPYC,
    },
    "sglang-live-admission-2026-11-29d-after-churn.json": {"commit": "6e3603b", "machine": EPYC},
    "sglang-live-admission-2026-11-29e-before-dlpm-churn.json": {
        "commit": "bbef320",
        "machine": EPYC,
    },
    "sglang-live-admission-2026-11-29e-after-churn.json": {"commit": "16b272c", "machine": EPYC},
}

README_QUOTES: list[str] = [
    "TTFT attainment {bicache-rate-ttft-32} at BE batch 32, {bicache-rate-ttft-256} at 256 and"
    " {bicache-rate-ttft-512} at 512, TPOT {bicache-rate-tpot-32}",
    "TTFT {bicache-vllm-ttft-32}, {bicache-vllm-ttft-256} and {bicache-vllm-ttft-512}, TPOT"
    " {bicache-vllm-tpot-32}",
    "in virtual time, {sim-speed-min/n}–{sim-speed-max/n}× faster than real time",
    "tokens wasted ({fs-wasted} vs rpm's {fs-wasted-rpm}), on rpm throttling low-rate benign"
    " users ({fs-rpm-benign-users}), on users queued ({fs-queued} vs VTC's {fs-queued-vtc};",
    "while overloaded ({fs-overloaded} VTC's;",
    "its throughput is {fs-throughput} VTC's (the claim against Fig. 9a, ≥ VTC's: **FAIL**;",
    "throttled by rpm ({fs-interactions}: the abusers' interactions dominate both counts;"
    " **FAIL**) and throttles {fs-benign-users} benign users",
    "pass costs {adm-dlpm-1000} SGLang's own lpm pass",
]
