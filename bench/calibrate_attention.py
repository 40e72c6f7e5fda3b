"""Attention for ``calibrate_gpu``: torch SDPA variants (backend × GQA layout) and a bmm decode,
checked against a float32 reference, timed on prefill and decode shapes over a contiguous KV
cache; the fastest variant per shape is its ``best``."""

from __future__ import annotations

import math

from calibrate_timing import error_text, rate

MIN_STREAM_BYTES = 256 << 20  # KV copies cycled until each measurement streams at least this


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
                    "flops_per_s": rate(flops, sec),
                    "frac_peak_flops": rate(flops, sec) / gpu.peak_flops,
                    "kv_bytes_per_s": rate(kv_bytes, sec),
                    "frac_peak_bw_kv": rate(kv_bytes, sec) / gpu.mem_bw,
                }
                if "note" in t:
                    info["note"] = t["note"]
                row["variants"][label] = info
                del sets
            except Exception as exc:
                row["variants"][label] = {"error": error_text(exc)}
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
