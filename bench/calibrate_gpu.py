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
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]

GEMM_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (1, 64, 1024)
LM_HEAD_ROWS = (1, 8, 32, 64, 128, 256)
PREFILL_SHAPES = ((512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0), (1024, 4096), (512, 2048))
DECODE_SHAPES = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (64, 2048), (128, 4096), (32, 8192))
STEP_PREFILLS = ((512, 0), (2048, 0), (8192, 0), (1024, 4096))
STEP_DECODES = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (64, 2048), (128, 4096))
WEIGHT_COPIES = 4  # layer copies cycled per measurement; 4 x 436 MiB (Llama-3.1-8B) >> 50 MiB L2
MIN_STREAM_BYTES = 256 << 20  # KV copies cycled until each measurement streams at least this

# Used only when worker/sim/hardware.py cannot be imported (same numbers, from that file).
_FALLBACK_MODELS = {
    "Llama-3.1-8B": dict(
        name="Llama-3.1-8B",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        dtype_bytes=2,
    ),
}
_FALLBACK_GPUS = {"H100-80GB": dict(name="H100-80GB", peak_flops=989e12, mem_bw=3.35e12)}


# ---- specs ---------------------------------------------------------------------------------


def load_specs(model: str, gpu: str) -> tuple[SimpleNamespace, SimpleNamespace, str]:
    """Model and GPU specs from sgl_fair's hardware.py (installed, or by file path), else a copy."""
    try:
        from sgl_fair.worker.sim.hardware import get_gpu, get_model

        source = "sgl_fair.worker.sim.hardware"
    except ImportError:
        path = REPO / "worker" / "sim" / "hardware.py"
        try:
            spec = importlib.util.spec_from_file_location("_sim_hardware", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up here
            spec.loader.exec_module(module)
            get_gpu, get_model = module.get_gpu, module.get_model
            source = str(path.relative_to(REPO))
        except Exception:
            get_gpu = lambda name: SimpleNamespace(**_FALLBACK_GPUS[name])
            get_model = lambda name: SimpleNamespace(**_FALLBACK_MODELS[name])
            source = "fallback copy in bench/calibrate_gpu.py"
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


# ---- timing --------------------------------------------------------------------------------


class Timer:
    """Times a callable on the GPU: CUDA graph of one call (eager if capture fails), replayed."""

    def __init__(self, torch, *, warmup: int, repeats: int, use_graphs: bool = True) -> None:
        self.torch = torch
        self.warmup = warmup
        self.repeats = repeats
        self.use_graphs = use_graphs and torch.cuda.is_available()

    def __call__(self, fn) -> dict:
        torch = self.torch
        if not torch.cuda.is_available():  # --allow-cpu smoke test only
            fn()
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return _summary(times, graph=False)
        runner, graph, note = fn, None, None
        if self.use_graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                runner = graph.replay
            except Exception as exc:  # some kernels refuse capture: time them eagerly
                torch.cuda.synchronize()
                graph, runner = None, fn
                note = f"graph capture failed, eager timing: {type(exc).__name__}: {exc}"[:300]
        for _ in range(self.warmup):
            runner()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            runner()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        del graph
        out = _summary(times, graph=runner is not fn)
        if note:
            out["note"] = note
        return out


def _summary(times: list[float], *, graph: bool) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
        "cuda_graph": graph,
    }


def _rate(value: float, seconds: float) -> float:
    return value / seconds if seconds > 0 else float("nan")


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


# ---- measurements --------------------------------------------------------------------------


def layer_gemm_shapes(m) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear of one decoder layer, as SGLang fuses them."""
    q = m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    h, i = m.hidden_size, m.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}


def measure_reference(torch, timer, gpu, dev, dtype, quick: bool) -> dict:
    out = {}
    n = 2048 if quick else 8192
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = timer(lambda: torch.mm(a, b))
    flops = 2 * n**3
    out["square_gemm"] = {
        "n": n,
        **t,
        "flops_per_s": _rate(flops, t["median_s"]),
        "frac_peak_flops": _rate(flops, t["median_s"]) / gpu.peak_flops,
    }
    a = b = None
    nbytes = (64 << 20) if quick else (2 << 30)
    src = torch.empty(nbytes // 2, device=dev, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    moved = 2 * nbytes  # read + write
    out["copy"] = {
        "bytes": nbytes,
        **t,
        "bytes_per_s": _rate(moved, t["median_s"]),
        "frac_peak_bw": _rate(moved, t["median_s"]) / gpu.mem_bw,
    }
    t = timer(lambda: src.sum(dtype=torch.float32))
    out["read_reduce"] = {
        "bytes": nbytes,
        **t,
        "bytes_per_s": _rate(nbytes, t["median_s"]),
        "frac_peak_bw": _rate(nbytes, t["median_s"]) / gpu.mem_bw,
    }
    return out


def make_layers(torch, m, dev, dtype, count: int) -> list[dict]:
    layers = []
    for _ in range(count):
        layer = {
            name: torch.randn(fout, fin, device=dev, dtype=dtype) * 0.02
            for name, (fin, fout) in layer_gemm_shapes(m).items()
        }
        layer["norm1"] = torch.ones(m.hidden_size, device=dev, dtype=dtype)
        layer["norm2"] = torch.ones(m.hidden_size, device=dev, dtype=dtype)
        layers.append(layer)
    return layers


def rms_norm(torch, x, w, eps: float = 1e-5):
    F = torch.nn.functional
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def measure_gemms(torch, timer, m, gpu, dev, dtype, layers, tokens) -> list[dict]:
    F = torch.nn.functional
    shapes = layer_gemm_shapes(m)
    n = len(layers)
    inter = m.intermediate_size
    rows = []
    for t_count in tokens:
        row = {"tokens": t_count, "gemms": {}}
        xs = {fin: torch.randn(t_count, fin, device=dev, dtype=dtype) for fin, _ in shapes.values()}
        total_flops = total_wbytes = 0
        for name, (fin, fout) in shapes.items():
            x = xs[fin]
            flops = 2 * t_count * fin * fout
            wbytes = fin * fout * m.dtype_bytes
            io_bytes = wbytes + t_count * (fin + fout) * m.dtype_bytes
            total_flops += flops
            total_wbytes += wbytes
            try:
                t = timer(lambda x=x, name=name: [F.linear(x, layer[name]) for layer in layers])
                sec = t["median_s"] / n
                row["gemms"][name] = {
                    "shape_in_out": [fin, fout],
                    "time_s": sec,
                    "cuda_graph": t["cuda_graph"],
                    "flops_per_s": _rate(flops, sec),
                    "frac_peak_flops": _rate(flops, sec) / gpu.peak_flops,
                    "weight_bytes_per_s": _rate(wbytes, sec),
                    "frac_peak_bw_weights": _rate(wbytes, sec) / gpu.mem_bw,
                    "frac_peak_bw_io": _rate(io_bytes, sec) / gpu.mem_bw,
                }
            except Exception as exc:
                row["gemms"][name] = {"error": _err(exc)}

        h, xq, xi = xs[m.hidden_size], xs[shapes["o"][0]], xs[inter]
        gate_up_out = torch.randn(t_count, 2 * inter, device=dev, dtype=dtype)

        def linears_only(h=h, xq=xq, xi=xi):
            for layer in layers:
                F.linear(h, layer["qkv"])
                F.linear(xq, layer["o"])
                F.linear(h, layer["gate_up"])
                F.linear(xi, layer["down"])

        def elementwise_only(h=h, gate_up_out=gate_up_out):  # torch-native, unfused
            for layer in layers:
                r = h + rms_norm(torch, h, layer["norm1"])
                b = rms_norm(torch, r, layer["norm2"])
                F.silu(gate_up_out[:, :inter]) * gate_up_out[:, inter:]
                r + b

        try:
            t = timer(linears_only)
            sec = t["median_s"] / n
            row["layer_linears"] = {
                "time_s": sec,
                "cuda_graph": t["cuda_graph"],
                "flops": total_flops,
                "weight_bytes": total_wbytes,
                "flops_per_s": _rate(total_flops, sec),
                "frac_peak_flops": _rate(total_flops, sec) / gpu.peak_flops,
                "weight_bytes_per_s": _rate(total_wbytes, sec),
                "frac_peak_bw_weights": _rate(total_wbytes, sec) / gpu.mem_bw,
            }
        except Exception as exc:
            row["layer_linears"] = {"error": _err(exc)}
        try:
            t = timer(elementwise_only)
            row["layer_elementwise"] = {
                "time_s": t["median_s"] / n,
                "what": "2x rms_norm, silu*mul, 2x residual add; plain torch ops, unfused",
            }
        except Exception as exc:
            row["layer_elementwise"] = {"error": _err(exc)}
        rows.append(row)
    return rows


def measure_lm_head(torch, timer, m, gpu, dev, dtype, rows_list) -> list[dict]:
    F = torch.nn.functional
    w = torch.randn(m.vocab_size, m.hidden_size, device=dev, dtype=dtype) * 0.02
    flops_per_row = 2 * m.vocab_size * m.hidden_size
    wbytes = m.vocab_size * m.hidden_size * m.dtype_bytes
    out = []
    for rows in rows_list:
        x = torch.randn(rows, m.hidden_size, device=dev, dtype=dtype)
        try:
            sec = timer(lambda x=x: F.linear(x, w))["median_s"]
            out.append(
                {
                    "rows": rows,
                    "time_s": sec,
                    "frac_peak_flops": _rate(rows * flops_per_row, sec) / gpu.peak_flops,
                    "frac_peak_bw_weights": _rate(wbytes, sec) / gpu.mem_bw,
                }
            )
        except Exception as exc:
            out.append({"rows": rows, "error": _err(exc)})
    return out


class Attention:
    """SDPA variants (backend x GQA layout) plus a three-kernel bmm decode; all [B, H, S, D]."""

    BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")

    def __init__(self, torch, m, dev, dtype) -> None:
        self.torch, self.m, self.dev, self.dtype = torch, m, dev, dtype
        self.F = torch.nn.functional
        self.group = m.num_heads // m.num_kv_heads
        self.scale = 1.0 / math.sqrt(m.head_dim)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.sdpa_kernel = sdpa_kernel
            self.backends = {
                b: getattr(SDPBackend, b) for b in self.BACKENDS if hasattr(SDPBackend, b)
            }
        except ImportError:
            self.sdpa_kernel, self.backends = None, {}
        try:
            from torch.nn.attention.bias import causal_lower_right

            self.causal_lower_right = causal_lower_right
        except ImportError:
            self.causal_lower_right = None
        self.has_enable_gqa = self._probe_enable_gqa()

    def _probe_enable_gqa(self) -> bool:
        t, m = self.torch, self.m
        q = t.randn(1, m.num_heads, 4, m.head_dim, device=self.dev, dtype=self.dtype)
        k = t.randn(1, m.num_kv_heads, 4, m.head_dim, device=self.dev, dtype=self.dtype)
        try:
            self.F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            return True
        except TypeError:
            return False

    def candidates(self, kind: str) -> list[tuple[str, str]]:
        """(backend, layout) pairs to try; layout 'enable_gqa' | 'expanded' | 'packed'."""
        layouts = ["enable_gqa"] if self.has_enable_gqa else []
        # Prefill: K/V repeated to all query heads (4x KV, but prefill attention is compute-
        # bound). Decode: the query heads of a KV group as query rows, the exact GQA decode.
        layouts.append("expanded" if kind == "prefill" else "packed")
        backends = list(self.backends) or ["default"]
        out = [(b, lay) for lay in layouts for b in backends]
        if kind == "decode":
            out.append(("bmm", "packed"))
        return out

    def tensors(self, batch, num_new, num_kv, layout):
        t, m = self.torch, self.m
        d, hq, hk = m.head_dim, m.num_heads, m.num_kv_heads
        if layout == "packed":
            q = t.randn(batch, hk, self.group * num_new, d, device=self.dev, dtype=self.dtype)
        else:
            q = t.randn(batch, hq, num_new, d, device=self.dev, dtype=self.dtype)
        heads = hq if layout == "expanded" else hk
        k = t.randn(batch, heads, num_kv, d, device=self.dev, dtype=self.dtype)
        v = t.randn(batch, heads, num_kv, d, device=self.dev, dtype=self.dtype)
        return q, k, v

    def call(self, q, k, v, *, backend, layout, num_new, num_context):
        """Attention of num_new query tokens over num_context earlier tokens plus themselves."""
        if backend == "bmm":
            s = self.torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
            return self.torch.matmul(self.torch.softmax(s, dim=-1).to(q.dtype), v)
        kwargs = {"enable_gqa": True} if layout == "enable_gqa" else {}
        if num_new == 1:
            pass  # one query token sees every key: no mask
        elif num_context == 0:
            kwargs["is_causal"] = True
        else:
            if self.causal_lower_right is None:
                raise RuntimeError("torch lacks causal_lower_right; prefix prefill not measured")
            kwargs["attn_mask"] = self.causal_lower_right(num_new, num_new + num_context)
        if backend == "default" or self.sdpa_kernel is None:
            return self.F.scaled_dot_product_attention(q, k, v, **kwargs)
        with self.sdpa_kernel([self.backends[backend]]):
            return self.F.scaled_dot_product_attention(q, k, v, **kwargs)

    def check(self, backend: str, layout: str, kind: str) -> float:
        """Max |variant - float32 reference| on small seeded inputs (context 128 + new)."""
        t, m = self.torch, self.m
        gen = t.Generator(device=self.dev).manual_seed(1234)
        b, num_new, num_context = 2, (1 if kind == "decode" else 64), 128
        num_kv = num_context + num_new
        d, hq, hk = m.head_dim, m.num_heads, m.num_kv_heads
        kw = {"device": self.dev, "dtype": self.dtype, "generator": gen}
        q, k, v = (
            t.randn(b, h, s, d, **kw) for h, s in ((hq, num_new), (hk, num_kv), (hk, num_kv))
        )
        kf = k.float().repeat_interleave(self.group, 1)
        vf = v.float().repeat_interleave(self.group, 1)
        s = t.matmul(q.float(), kf.transpose(-1, -2)) * self.scale
        qi = t.arange(num_new, device=self.dev)[:, None] + num_context
        kj = t.arange(num_kv, device=self.dev)[None, :]
        ref = t.matmul(t.softmax(s.masked_fill(kj > qi, float("-inf")), -1), vf)
        if layout == "expanded":
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
        if layout == "packed":  # query head h belongs to KV head h // group
            q = q.reshape(b, hk, self.group * num_new, d)
        out = self.call(
            q, k, v, backend=backend, layout=layout, num_new=num_new, num_context=num_context
        )
        out = out.float().reshape(b, hq, num_new, d)
        return (out - ref).abs().max().item()


def kv_bytes_of(m, batch: int, num_kv: int) -> int:
    return batch * num_kv * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes


def attention_flops(m, batch: int, num_new: int, num_context: int) -> float:
    """Causal useful FLOPs of one layer, counted exactly as cost_model does."""
    return 4 * m.num_heads * m.head_dim * batch * num_new * (num_context + 0.5 * num_new)


def measure_attention(torch, timer, att, m, gpu, kind, shapes) -> list[dict]:
    """kind 'prefill': shapes are (new, context) at batch 1; 'decode': (batch, context)."""
    rows = []
    for shape in shapes:
        if kind == "prefill":
            batch, (num_new, num_context) = 1, shape
        else:
            (batch, num_context), num_new = shape, 1
        # Decode: the KV cache holds `context` tokens (the new token's own K/V is not modelled).
        num_kv = num_context + num_new if kind == "prefill" else num_context
        flops = attention_flops(m, batch, num_new, num_context)
        kv_bytes = kv_bytes_of(m, batch, num_kv)
        copies = 1 if kind == "prefill" else max(1, min(64, -(-MIN_STREAM_BYTES // kv_bytes)))
        row = {
            "batch": batch,
            "num_new": num_new,
            "num_context": num_context,
            "kv_copies_cycled": copies,
            "flops": flops,
            "kv_bytes": kv_bytes,
            "variants": {},
        }
        for backend, layout in att.candidates(kind):
            label = f"{backend}/{layout}"
            try:
                sets = [att.tensors(batch, num_new, num_kv, layout) for _ in range(copies)]
                kw = {"backend": backend, "layout": layout, "num_new": num_new}
                kw["num_context"] = num_context if kind == "prefill" else num_kv - 1

                def fn(sets=sets, kw=kw):
                    return [att.call(*s, **kw) for s in sets]

                t = timer(fn)
                sec = t["median_s"] / copies
                info = {
                    "time_s": sec,
                    "cuda_graph": t["cuda_graph"],
                    "flops_per_s": _rate(flops, sec),
                    "frac_peak_flops": _rate(flops, sec) / gpu.peak_flops,
                    "kv_bytes_per_s": _rate(kv_bytes, sec),
                    "frac_peak_bw_kv": _rate(kv_bytes, sec) / gpu.mem_bw,
                }
                if "note" in t:
                    info["note"] = t["note"]
                row["variants"][label] = info
                del sets
            except Exception as exc:
                row["variants"][label] = {"error": _err(exc)}
        ok = {k: v for k, v in row["variants"].items() if "time_s" in v}
        if ok:
            best = min(ok, key=lambda k: ok[k]["time_s"])
            row["best"] = {"variant": best, **ok[best]}
        rows.append(row)
    return rows


def best_variant(rows: list[dict]) -> str | None:
    """The variant with the least total time over the shapes where every variant ran."""
    labels = {k for r in rows for k, v in r["variants"].items() if "time_s" in v}
    good = [lab for lab in labels if all("time_s" in r["variants"].get(lab, {}) for r in rows)]
    if not good:
        return None
    return min(good, key=lambda lab: sum(r["variants"][lab]["time_s"] for r in rows))


def measure_steps(torch, timer, att, m, gpu, dev, dtype, variants, num_layers, quick) -> dict:
    """Whole forward passes: num_layers x (norm, QKV, attention, O, norm, gate_up, act, down)."""
    F = torch.nn.functional
    inter, q_size = m.intermediate_size, m.num_heads * m.head_dim
    layers = make_layers(torch, m, dev, dtype, num_layers)
    lm_head = torch.randn(m.vocab_size, m.hidden_size, device=dev, dtype=dtype) * 0.02
    out = {"num_layers": num_layers, "attention_variants": variants, "prefill": [], "decode": []}
    prefills = STEP_PREFILLS[:2] if quick else STEP_PREFILLS
    decodes = STEP_DECODES[:2] if quick else STEP_DECODES
    cases = [("prefill", 1, n, c) for n, c in prefills] + [("decode", b, 1, c) for b, c in decodes]
    for kind, batch, num_new, num_context in cases:
        backend, layout = variants[kind].split("/")
        num_tokens = batch * num_new
        num_kv = num_context + num_new if kind == "prefill" else num_context
        per_layer_kv = kv_bytes_of(m, batch, num_kv) * (
            m.num_heads // m.num_kv_heads if layout == "expanded" else 1
        )
        # Distinct KV per layer when it fits; else two buffers, each far larger than L2.
        kv_sets = num_layers if per_layer_kv * num_layers <= (16 << 30) else 2
        rec = {
            "batch": batch,
            "num_new": num_new,
            "num_context": num_context,
            "attention": variants[kind],
            "kv_buffers": kv_sets,
        }
        try:
            kv = [att.tensors(batch, num_new, num_kv, layout) for _ in range(kv_sets)]
            x0 = torch.randn(num_tokens, m.hidden_size, device=dev, dtype=dtype)
            attn_out = torch.randn(num_tokens, q_size, device=dev, dtype=dtype)
            kw = {"backend": backend, "layout": layout, "num_new": num_new}
            kw["num_context"] = num_context if kind == "prefill" else num_kv - 1
            rows = 1 if kind == "prefill" else batch

            def forward(kv=kv, x0=x0, attn_out=attn_out, kw=kw, rows=rows):
                x = x0
                for i, layer in enumerate(layers):
                    a = rms_norm(torch, x, layer["norm1"])
                    F.linear(a, layer["qkv"])
                    att.call(*kv[i % len(kv)], **kw)
                    x = x + F.linear(attn_out, layer["o"])
                    gu = F.linear(rms_norm(torch, x, layer["norm2"]), layer["gate_up"])
                    x = x + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], layer["down"])
                return F.linear(x[-rows:], lm_head)

            t = timer(forward)
            rec.update(
                time_s=t["median_s"],
                min_s=t["min_s"],
                max_s=t["max_s"],
                cuda_graph=t["cuda_graph"],
                per_layer_kv_bytes=per_layer_kv,
            )
        except Exception as exc:
            rec["error"] = _err(exc)
        out[kind].append(rec)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


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
        return _err(exc)


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
    m, gpu, source = load_specs(args.model, args.gpu)
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
            result["errors"].append(f"{name}: {_err(exc)}")
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
                checks[f"{kind}:{backend}/{layout}"] = _err(exc)
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
