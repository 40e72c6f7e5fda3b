"""Fit `cost_model.Efficiency` from `bench/calibrate_gpu.py`'s JSON and check the cost model.

    python bench/fit_efficiency.py [bench/results/calibration-H100-80GB.json]

Fits, from the torch-kernel measurements:

* flops: GEMM FLOP/s over peak of one layer's four linears, median over >= 1024 tokens;
* bandwidth: weight bytes/s over peak of the same linears, median over 1..32 tokens;
* attention_flops: causal prefill attention FLOP/s over peak, all prefill shapes together
  (total FLOPs / total time of the fastest SDPA variant; the per-shape median is printed too);

and keeps step_overhead_s and link_bandwidth at their defaults (not measurable without SGLang /
on one GPU). Then it compares `CostModel.from_names(gpu, model)` step times, with the current
defaults and with the fitted factors, against what was measured:

* composed: (layer linears + fastest attention) per layer x num_layers + lm_head, the kernels
  the cost model prices, and
* full: one CUDA graph of every layer (with plain-torch, unfused norms and SiLU*mul, which
  SGLang fuses) plus the lm_head.

Predictions leave out `step_overhead_s`, which no kernel measurement includes. Pure Python and
numpy; prints Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from sgl_fair.worker.sim.cost_model import CostModel, Efficiency

DEFAULT_JSON = Path(__file__).parent / "results" / "calibration-H100-80GB.json"
FLOPS_MIN_TOKENS = 1024
BANDWIDTH_MAX_TOKENS = 32


def _ok(entry: dict | None) -> bool:
    return isinstance(entry, dict) and "time_s" in entry


def measured_fractions(data: dict) -> dict:
    """The fractions of peak the fit uses, plus context (reference ceilings, KV bandwidth)."""
    gemm = [r for r in data["gemm"] if _ok(r.get("layer_linears"))]
    big = [r["layer_linears"]["frac_peak_flops"] for r in gemm if r["tokens"] >= FLOPS_MIN_TOKENS]
    small = [
        r["layer_linears"]["frac_peak_bw_weights"]
        for r in gemm
        if r["tokens"] <= BANDWIDTH_MAX_TOKENS
    ]
    prefill = [r for r in data["attention_prefill"] if "best" in r]
    attn_each = [r["best"]["frac_peak_flops"] for r in prefill]
    peak = data["gpu_spec"]["peak_flops"]
    attn_total = sum(r["flops"] for r in prefill) / sum(r["best"]["time_s"] for r in prefill)
    decode = [r for r in data["attention_decode"] if "best" in r]
    ref = data.get("reference", {})
    return {
        "gemm_flops_by_tokens": {r["tokens"]: r["layer_linears"]["frac_peak_flops"] for r in gemm},
        "gemm_weight_bw_by_tokens": {
            r["tokens"]: r["layer_linears"]["frac_peak_bw_weights"] for r in gemm
        },
        "flops": float(np.median(big)),
        "bandwidth": float(np.median(small)),
        "attention_flops": attn_total / peak,
        "attention_flops_median": float(np.median(attn_each)),
        "attention_prefill_by_shape": {
            (r["num_new"], r["num_context"]): (r["best"]["frac_peak_flops"], r["best"]["variant"])
            for r in prefill
        },
        "kv_bw_by_shape": {
            (r["batch"], r["num_context"]): (r["best"]["frac_peak_bw_kv"], r["best"]["variant"])
            for r in decode
        },
        "lm_head_bw_1row": next(
            (x["frac_peak_bw_weights"] for x in data.get("lm_head", []) if x.get("rows") == 1),
            None,
        ),
        "square_gemm": ref.get("square_gemm", {}).get("frac_peak_flops"),
        "copy_bw": ref.get("copy", {}).get("frac_peak_bw"),
        "read_bw": ref.get("read_reduce", {}).get("frac_peak_bw"),
    }


def fitted_efficiency(fractions: dict, default: Efficiency) -> Efficiency:
    return dataclasses.replace(
        default,
        flops=round(fractions["flops"], 3),
        bandwidth=round(fractions["bandwidth"], 3),
        attention_flops=round(fractions["attention_flops"], 3),
    )


def composed_times(data: dict) -> list[dict]:
    """Per-layer measurements x num_layers + lm_head, for every shape all parts exist for."""
    num_layers = data["model"]["num_layers"]
    linears = {r["tokens"]: r["layer_linears"]["time_s"] for r in data["gemm"]}
    elementwise = {
        r["tokens"]: r["layer_elementwise"]["time_s"]
        for r in data["gemm"]
        if _ok(r.get("layer_elementwise"))
    }
    lm_head = {x["rows"]: x["time_s"] for x in data.get("lm_head", []) if _ok(x)}
    cases = []
    for kind in ("prefill", "decode"):
        for r in data[f"attention_{kind}"]:
            tokens, rows = r["batch"] * r["num_new"], r["batch"]
            if "best" not in r or tokens not in linears or rows not in lm_head:
                continue
            per_layer = linears[tokens] + r["best"]["time_s"]
            cases.append(
                {
                    "kind": kind,
                    "batch": r["batch"],
                    "num_new": r["num_new"],
                    "num_context": r["num_context"],
                    "linears_s": num_layers * linears[tokens],
                    "attention_s": num_layers * r["best"]["time_s"],
                    "lm_head_s": lm_head[rows],
                    "elementwise_s": num_layers * elementwise.get(tokens, float("nan")),
                    "composed_s": num_layers * per_layer + lm_head[rows],
                }
            )
    return cases


def full_steps(data: dict) -> dict[tuple, float]:
    steps = data.get("steps") or {}
    out = {}
    for kind in ("prefill", "decode"):
        for r in steps.get(kind, []):
            if _ok(r):
                out[(kind, r["batch"], r["num_new"], r["num_context"])] = r["time_s"]
    return out


def predict(cm: CostModel, kind: str, batch: int, num_new: int, num_context: int) -> float:
    """Step seconds without step_overhead_s (no kernel measurement contains it)."""
    if kind == "prefill":
        t = cm.step_time(prefill_chunks=[(num_new, num_context)] * batch)
    else:
        t = cm.step_time(decode_context_lens=[num_context] * batch)
    return t - cm.efficiency.step_overhead_s


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def _shape(case: dict) -> str:
    if case["kind"] == "prefill":
        return f"prefill {case['num_new']} new + {case['num_context']} ctx"
    return f"decode {case['batch']} x {case['num_context']} ctx"


def report(data: dict, gpu: str | None = None, model: str | None = None) -> dict:
    gpu = gpu or data["gpu_spec"]["name"]
    model = model or data["model"]["name"]
    default_cm = CostModel.from_names(gpu, model)
    fr = measured_fractions(data)
    fitted = fitted_efficiency(fr, default_cm.efficiency)
    fitted_cm = CostModel.from_names(gpu, model, tp=default_cm.tp, efficiency=fitted)
    dev = data.get("device", {})

    print(f"## {gpu} / {model}: fitted efficiency\n")
    print(
        f"Device: {dev.get('name')}, torch {dev.get('torch')}, measured {data.get('date_utc')}.\n"
    )
    print("| factor | default | fitted | from |")
    print("|---|---|---|---|")
    d = default_cm.efficiency
    print(
        f"| flops | {d.flops:.2f} | {fitted.flops:.2f} | layer GEMMs, median over "
        f">= {FLOPS_MIN_TOKENS} tokens |"
    )
    print(
        f"| bandwidth | {d.bandwidth:.2f} | {fitted.bandwidth:.2f} | layer weight reads, median "
        f"over 1..{BANDWIDTH_MAX_TOKENS} tokens |"
    )
    print(
        f"| attention_flops | {d.attention_flops:.2f} | {fitted.attention_flops:.2f} | "
        "SDPA prefill, total FLOPs / total time "
        f"(per-shape median {fr['attention_flops_median']:.2f}) |"
    )
    print(f"| step_overhead_s | {d.step_overhead_s * 1e3:.1f} ms | unchanged | not measured |")
    print(f"| link_bandwidth | {d.link_bandwidth:.2f} | unchanged | not measured (tp=1) |\n")

    print("### Measured fractions of datasheet peak\n")
    print("| tokens | GEMM FLOP/s | weight bytes/s |")
    print("|---|---|---|")
    for t, f in fr["gemm_flops_by_tokens"].items():
        print(f"| {t} | {f:.3f} | {fr['gemm_weight_bw_by_tokens'][t]:.3f} |")
    print("\n| prefill attention (new, context) | FLOP/s | fastest variant |")
    print("|---|---|---|")
    for (n, c), (f, v) in fr["attention_prefill_by_shape"].items():
        print(f"| ({n}, {c}) | {f:.3f} | {v} |")
    print("\n| decode attention (batch x context) | KV bytes/s | fastest variant |")
    print("|---|---|---|")
    for (b, c), (f, v) in fr["kv_bw_by_shape"].items():
        print(f"| {b} x {c} | {f:.3f} | {v} |")
    print(
        f"\nReference ceilings: square 8192^3 GEMM {fr['square_gemm']:.3f} of peak FLOP/s; "
        f"copy {fr['copy_bw']:.3f} and read-only reduction {fr['read_bw']:.3f} of peak bandwidth;"
        f" lm_head GEMV (1 row) {fr['lm_head_bw_1row']:.3f}.\n"
    )

    cases = composed_times(data)
    full = full_steps(data)
    print("### Step time: cost model (without step_overhead_s) vs measured\n")
    print(
        "composed = (layer linears + attention) x layers + lm_head, the kernels the cost model "
        "prices; full = one CUDA graph of all layers with plain-torch (unfused) norms and SiLU*mul "
        "plus the lm_head. Errors: (model - measured) / measured.\n"
    )
    print(
        "| shape | composed | full | default model | vs composed | vs full "
        "| fitted model | vs composed | vs full |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for c in cases:
        key = (c["kind"], c["batch"], c["num_new"], c["num_context"])
        meas_full = full.get(key)
        row = {**c, "full_s": meas_full}
        cells = [_shape(c), f"{c['composed_s'] * 1e3:.2f} ms"]
        cells.append(f"{meas_full * 1e3:.2f} ms" if meas_full is not None else "-")
        for name, cm in (("default", default_cm), ("fitted", fitted_cm)):
            pred = predict(cm, *key)
            row[f"{name}_s"] = pred
            row[f"{name}_err_composed"] = (pred - c["composed_s"]) / c["composed_s"]
            cells += [f"{pred * 1e3:.2f} ms", _pct(pred, c["composed_s"])]
            if meas_full is not None:
                row[f"{name}_err_full"] = (pred - meas_full) / meas_full
                cells.append(_pct(pred, meas_full))
            else:
                cells.append("-")
        rows.append(row)
        print("| " + " | ".join(cells) + " |")
    print()
    for name in ("default", "fitted"):
        for target in ("composed", "full"):
            errs = np.abs([r[f"{name}_err_{target}"] for r in rows if f"{name}_err_{target}" in r])
            print(
                f"- {name} factors vs {target}: mean |error| {100 * errs.mean():.1f}%, "
                f"max {100 * errs.max():.1f}% ({len(errs)} shapes)"
            )
    print("\n")
    print("Per-phase split of the composed time (ms):\n")
    print("| shape | linears | attention | lm_head | torch norms+act (separate bench) |")
    print("|---|---|---|---|---|")
    for c in cases:
        print(
            f"| {_shape(c)} | {c['linears_s'] * 1e3:.2f} | {c['attention_s'] * 1e3:.2f} | "
            f"{c['lm_head_s'] * 1e3:.2f} | {c['elementwise_s'] * 1e3:.2f} |"
        )
    return {"fractions": fr, "fitted": fitted, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", default=str(DEFAULT_JSON))
    ap.add_argument("--gpu", help="spec name; default: the JSON's gpu_spec")
    ap.add_argument("--model", help="model name; default: the JSON's model")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    out = report(data, args.gpu, args.model)
    f = out["fitted"]
    print(
        f"\nEfficiency(flops={f.flops}, bandwidth={f.bandwidth}, "
        f"attention_flops={f.attention_flops}, step_overhead_s={f.step_overhead_s})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
