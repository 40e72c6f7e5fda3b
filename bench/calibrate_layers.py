"""Dense kernels for ``calibrate_gpu``: the reference ceilings (square GEMM, copy, reduction),
one decoder layer's linears and elementwise ops, the lm_head, and synthetic whole steps (every
layer plus the lm_head, with the best attention variant)."""

from __future__ import annotations

from calibrate_attention import kv_bytes_of
from calibrate_timing import error_text, rate

STEP_PREFILLS = ((512, 0), (2048, 0), (8192, 0), (1024, 4096))
STEP_DECODES = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (64, 2048), (128, 4096))


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
        "flops_per_s": rate(flops, t["median_s"]),
        "frac_peak_flops": rate(flops, t["median_s"]) / gpu.peak_flops,
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
        "bytes_per_s": rate(moved, t["median_s"]),
        "frac_peak_bw": rate(moved, t["median_s"]) / gpu.mem_bw,
    }
    t = timer(lambda: src.sum(dtype=torch.float32))
    out["read_reduce"] = {
        "bytes": nbytes,
        **t,
        "bytes_per_s": rate(nbytes, t["median_s"]),
        "frac_peak_bw": rate(nbytes, t["median_s"]) / gpu.mem_bw,
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
                    "flops_per_s": rate(flops, sec),
                    "frac_peak_flops": rate(flops, sec) / gpu.peak_flops,
                    "weight_bytes_per_s": rate(wbytes, sec),
                    "frac_peak_bw_weights": rate(wbytes, sec) / gpu.mem_bw,
                    "frac_peak_bw_io": rate(io_bytes, sec) / gpu.mem_bw,
                }
            except Exception as exc:
                row["gemms"][name] = {"error": error_text(exc)}

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
                "flops_per_s": rate(total_flops, sec),
                "frac_peak_flops": rate(total_flops, sec) / gpu.peak_flops,
                "weight_bytes_per_s": rate(total_wbytes, sec),
                "frac_peak_bw_weights": rate(total_wbytes, sec) / gpu.mem_bw,
            }
        except Exception as exc:
            row["layer_linears"] = {"error": error_text(exc)}
        try:
            t = timer(elementwise_only)
            row["layer_elementwise"] = {
                "time_s": t["median_s"] / n,
                "what": "2x rms_norm, silu*mul, 2x residual add; plain torch ops, unfused",
            }
        except Exception as exc:
            row["layer_elementwise"] = {"error": error_text(exc)}
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
                    "frac_peak_flops": rate(rows * flops_per_row, sec) / gpu.peak_flops,
                    "frac_peak_bw_weights": rate(wbytes, sec) / gpu.mem_bw,
                }
            )
        except Exception as exc:
            out.append({"rows": rows, "error": error_text(exc)})
    return out


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
            rec["error"] = error_text(exc)
        out[kind].append(rec)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out
