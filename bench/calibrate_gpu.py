"""Measure what real torch kernels achieve on this GPU, to calibrate `cost_model.Efficiency`.

Measurement only: this script writes a JSON of timings and achieved fractions of the datasheet
peaks in `worker/sim/hardware.py`; `bench/fit_efficiency.py` turns it into fitted factors.

    python bench/calibrate_gpu.py --model Llama-3.1-8B --gpu H100-80GB --out calib.json

What it measures (bf16, CUDA events around CUDA-graph replays, warm-up, median of repeats):

* reference ceilings: one large square GEMM, a device-to-device copy and a read-only reduction;
* linear layers of one decoder layer (QKV, O, gate_up, down) for 1..8192 tokens, each GEMM and
  the four together; weights cycle over several layer copies so that no weight stays in L2;
* the lm_head GEMM for a few row counts;
* attention with `torch.nn.functional.scaled_dot_product_attention`: causal prefill
  (new tokens, context before) and single-token decode over a contiguous (not paged) KV cache,
  for each SDPA backend and GQA layout that works; the fastest variant is reported as `best`;
* synthetic steps: a graph of all decoder layers (norms, GEMMs, best attention, SiLU*mul,
  residual adds) plus the lm_head, for a few prefill and decode shapes, to compare end to end.

Not measurable without SGLang, hence not measured: the per-step fixed overhead
(`step_overhead_s`: scheduling, metadata, sampling), FlashInfer's paged kernels (SDPA is a proxy,
and likely a lower bound on decode efficiency), rotary/KV-cache writes, and TP all-reduces.

This file is the driver (specs, device, the JSON); the measurements are its siblings:
`calibrate_timing` (the timer), `calibrate_layers` (reference ceilings, GEMMs, lm_head, steps),
`calibrate_attention` (SDPA variants). The specs come from `worker/sim/hardware.py` only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

# Run as a script, this folder is on sys.path: the measurements are its sibling modules.
from calibrate_attention import Attention, best_variant, measure_attention
from calibrate_layers import (
    make_layers,
    measure_gemms,
    measure_lm_head,
    measure_reference,
    measure_steps,
)
from calibrate_timing import Timer, error_text

REPO = Path(__file__).resolve().parents[1]

GEMM_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (1, 64, 1024)
LM_HEAD_ROWS = (1, 8, 32, 64, 128, 256)
PREFILL_SHAPES = ((512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0), (1024, 4096), (512, 2048))
DECODE_SHAPES = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (64, 2048), (128, 4096), (32, 8192))
WEIGHT_COPIES = 4  # layer copies cycled per measurement; 4 x 436 MiB (Llama-3.1-8B) >> 50 MiB L2


# ---- specs ---------------------------------------------------------------------------------


def load_specs(model: str, gpu: str) -> tuple[SimpleNamespace, SimpleNamespace, str]:
    """Model and GPU specs from `worker/sim/hardware.py`, the one place they are written down:
    the installed sgl_fair, else that file by path (it imports only the standard library), so a
    GPU machine with torch and a copy of this repository needs nothing installed."""
    try:
        from sgl_fair.worker.sim.hardware import get_gpu, get_model

        source = "sgl_fair.worker.sim.hardware"
    except ImportError:
        path = REPO / "worker" / "sim" / "hardware.py"
        if not path.is_file():
            raise FileNotFoundError(
                f"sgl_fair is not installed and {path} is missing: run from a copy of the "
                "sgl-fair repository"
            ) from None
        spec = importlib.util.spec_from_file_location("_sim_hardware", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
        get_gpu, get_model = module.get_gpu, module.get_model
        source = str(path.relative_to(REPO))
    m, g = get_model(model), get_gpu(gpu)
    fields = (
        "name",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "dtype_bytes",
    )
    model_ns = SimpleNamespace(**{f: getattr(m, f) for f in fields})
    gpu_ns = SimpleNamespace(name=g.name, peak_flops=g.peak_flops, mem_bw=g.mem_bw)
    return model_ns, gpu_ns, source


# ---- driver --------------------------------------------------------------------------------


def nvidia_smi() -> dict | str:
    """Read-only query of the driver, clocks and power limit (changes nothing)."""
    query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,pstate"
    try:
        res = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return dict(zip(query.split(","), res.stdout.strip().split(", "), strict=False))
    except Exception as exc:
        return error_text(exc)


def device_info(torch) -> dict:
    info = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            name=p.name,
            capability=f"{p.major}.{p.minor}",
            sm_count=p.multi_processor_count,
            total_memory_bytes=p.total_memory,
            cudnn=torch.backends.cudnn.version(),
        )
        info["nvidia_smi"] = nvidia_smi()
    return info


NOTES = [
    "Attention uses torch SDPA (FlashAttention-2 / cuDNN / memory-efficient backends) on a "
    "contiguous KV cache as a proxy for FlashInfer's paged kernels, which SGLang uses; for decode "
    "it is likely a lower bound on the efficiency SGLang reaches.",
    "step_overhead_s (scheduling, metadata, sampling, launches SGLang does not hide) cannot be "
    "measured without SGLang; leave it as it is.",
    "GEMMs are torch.nn.functional.linear (cuBLAS/cuBLASLt), bf16 in and out, weights [out, in] "
    "as in the model; each measurement cycles over several weight copies so weights stream from "
    "HBM and times are per layer.",
    "Times are medians of CUDA-event timings around CUDA-graph replays (eager where capture "
    "failed), after warm-up; fractions are of the datasheet peaks in worker/sim/hardware.py.",
    "Synthetic steps run every decoder layer once (plain torch norms and SiLU*mul, no rotary, no "
    "KV-cache write, no sampling) plus the lm_head on one row per sequence.",
    "TP all-reduces are not measured (one GPU).",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--gpu", default="H100-80GB", help="spec name in worker/sim/hardware.py")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="few shapes and repeats (smoke test)")
    ap.add_argument("--no-steps", action="store_true", help="skip the synthetic full steps")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("calibrate_gpu: torch is not installed; run this on a CUDA machine", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("calibrate_gpu: no CUDA device visible to torch; nothing measured", file=sys.stderr)
        return 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # Variants a backend cannot run are recorded as errors; torch's warnings about them are noise.
    for noise in ("For dense input", ".*kernel not used because", ".*has been runtime disabled"):
        warnings.filterwarnings("ignore", message=noise, category=UserWarning)
    dtype = torch.bfloat16
    try:
        m, gpu, source = load_specs(args.model, args.gpu)
    except FileNotFoundError as exc:
        print(f"calibrate_gpu: no specs: {exc}", file=sys.stderr)
        return 2
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    warmup, repeats = (1, 3) if args.quick else (args.warmup, args.repeats)
    timer = Timer(torch, warmup=warmup, repeats=repeats)
    step_timer = Timer(torch, warmup=min(warmup, 3), repeats=max(3, repeats // 2))
    torch.manual_seed(0)

    started = time.time()
    result = {
        "schema": "sgl-fair/gpu-calibration/1",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(torch),
        "gpu_spec": vars(gpu),
        "model": vars(m),
        "spec_source": source,
        "dtype": "bfloat16",
        "method": {"warmup": warmup, "repeats": repeats, "weight_copies": WEIGHT_COPIES},
        "notes": NOTES,
        "errors": [],
    }
    dev_name = result["device"].get("name", "")
    if dev == "cuda" and "H100" in gpu.name and "H100" not in dev_name:
        result["notes"].append(f"WARNING: spec {gpu.name} but device is {dev_name!r}")

    def save() -> None:
        result["elapsed_s"] = round(time.time() - started, 1)
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    def section(name, fn):
        t0 = time.time()
        try:
            result[name] = fn()
        except Exception as exc:
            result["errors"].append(f"{name}: {error_text(exc)}")
        print(f"calibrate_gpu: {name} done in {time.time() - t0:.1f}s", flush=True)
        save()

    section("reference", lambda: measure_reference(torch, timer, gpu, dev, dtype, args.quick))
    tokens = QUICK_TOKENS if args.quick else GEMM_TOKENS
    copies = 1 if args.quick else WEIGHT_COPIES
    section(
        "gemm",
        lambda: measure_gemms(
            torch, timer, m, gpu, dev, dtype, make_layers(torch, m, dev, dtype, copies), tokens
        ),
    )
    lm_rows = LM_HEAD_ROWS[:2] if args.quick else LM_HEAD_ROWS
    section("lm_head", lambda: measure_lm_head(torch, timer, m, gpu, dev, dtype, lm_rows))

    att = Attention(torch, m, dev, dtype)
    result["attention_api"] = {
        "enable_gqa": att.has_enable_gqa,
        "backends": list(att.backends),
        "causal_lower_right": att.causal_lower_right is not None,
    }
    checks = {}
    for kind in ("prefill", "decode"):
        for backend, layout in att.candidates(kind):
            try:
                checks[f"{kind}:{backend}/{layout}"] = att.check(backend, layout, kind)
            except Exception as exc:
                checks[f"{kind}:{backend}/{layout}"] = error_text(exc)
    result["attention_checks_max_abs_err"] = checks
    prefill_shapes = PREFILL_SHAPES[:2] + PREFILL_SHAPES[-1:] if args.quick else PREFILL_SHAPES
    decode_shapes = DECODE_SHAPES[:2] if args.quick else DECODE_SHAPES
    section(
        "attention_prefill",
        lambda: measure_attention(torch, timer, att, m, gpu, "prefill", prefill_shapes),
    )
    section(
        "attention_decode",
        lambda: measure_attention(torch, timer, att, m, gpu, "decode", decode_shapes),
    )

    if not args.no_steps:
        variants = {
            kind: best_variant(result.get(f"attention_{kind}", []))
            for kind in ("prefill", "decode")
        }
        if all(variants.values()):
            num_layers = 2 if args.quick else m.num_layers
            section(
                "steps",
                lambda: measure_steps(
                    torch, step_timer, att, m, gpu, dev, dtype, variants, num_layers, args.quick
                ),
            )
        else:
            result["errors"].append(f"steps: no attention variant ran everywhere: {variants}")
    if dev == "cuda":
        result["device"]["nvidia_smi_end"] = nvidia_smi()
    save()
    print(f"calibrate_gpu: wrote {out_path} in {result['elapsed_s']}s", flush=True)
    if result["errors"]:
        print("calibrate_gpu: errors:\n  " + "\n  ".join(result["errors"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
