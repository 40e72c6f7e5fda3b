"""Bidirectional paged decode attention on a GPU: the Triton kernel on a BROS layout vs the same
kernel all-forward vs torch SDPA on K/V gathered into contiguous tensors.

fp16, Llama-8B-like heads (32 query, 8 KV, head dim 128), block size 16; batch sizes 1..256,
contexts 512..8192 (every sequence of a row has the same context). Prints µs per call and
KV tokens read per second, and returns the rows. SDPA's time excludes the gather (the layout
it would need is what the paged kernels avoid); ``sdpa+gather`` includes it. Pairs whose KV
cache would not fit in a quarter of the GPU's memory are skipped. Without CUDA it says so and
exits 0.

    python bench/bench_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192)


def _time_us(torch, fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def bench_one(torch, batch: int, ctx: int, iters: int) -> dict:
    from sgl_fair.kernels.bidir_attention import decode_attention
    from sgl_fair.kernels.block_table import BlockTable, forward_pieces
    from sgl_fair.kernels.reference import decode_attention_ref

    dev, dt = "cuda", torch.float16
    lens = [ctx] * batch
    fw_pieces, blocks = forward_pieces(lens, BLOCK)
    # BROS: RT (even) sequences read their blocks left→right, BE (odd) ones right→left; the
    # last blocks of an RT/BE pair share one block when the context is not a block multiple
    bi_pieces = _paired(lens)
    bi = BlockTable.from_pieces(bi_pieces, BLOCK, device=dev)
    fw = BlockTable.from_pieces(fw_pieces, BLOCK, device=dev)
    blocks = max(blocks, bi.num_blocks_used())
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt)
    slots = torch.stack([bi.slot_indices(b) for b in range(batch)])  # [B, ctx]
    flat_k = k_cache.view(-1, KV_HEADS, HEAD_DIM)
    flat_v = v_cache.view(-1, KV_HEADS, HEAD_DIM)

    def gather():
        k = flat_k[slots].transpose(1, 2)  # [B, Hkv, ctx, D]
        v = flat_v[slots].transpose(1, 2)
        return k, v

    k_g, v_g = gather()
    qs = q.unsqueeze(2)  # [B, H, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run_sdpa(k, v):
        return sdpa(qs, k, v, enable_gqa=True)

    n = min(batch, 2)  # a spot check against the reference
    sub = BlockTable.from_pieces(bi_pieces[:n], BLOCK, device=dev)
    ref = decode_attention_ref(q[:n], k_cache, v_cache, sub)
    err = (decode_attention(q, k_cache, v_cache, bi)[:n].float() - ref.float()).abs().max().item()
    us = {
        "bidir": _time_us(torch, lambda: decode_attention(q, k_cache, v_cache, bi), iters),
        "all_forward": _time_us(torch, lambda: decode_attention(q, k_cache, v_cache, fw), iters),
        "sdpa": _time_us(torch, lambda: run_sdpa(k_g, v_g), iters),
        "sdpa+gather": _time_us(torch, lambda: run_sdpa(*gather()), iters),
    }
    return {"batch": batch, "ctx": ctx, "us": us, "max_err_vs_ref": err}


def _paired(lens: list[int]) -> list[list[tuple[int, int, int, int]]]:
    """Sequence 2i (RT) from the left, 2i+1 (BE) from the right, in fresh blocks; a pair's
    partial tails share one block when they fit in it."""
    out, nxt = [], 0
    for i in range(0, len(lens), 2):
        pair = lens[i : i + 2]
        tails = [n % BLOCK for n in pair]
        shared = len(pair) == 2 and tails[0] > 0 and tails[1] > 0 and sum(tails) <= BLOCK
        rows = []
        for side, n in enumerate(pair):
            row = []
            full = n // BLOCK if shared else -(-n // BLOCK)
            for j in range(full):
                row.append((nxt, side, 0, min(BLOCK, n - j * BLOCK)))
                nxt += 1
            rows.append(row)
        if shared:
            for side, row in enumerate(rows):
                row.append((nxt, side, 0, tails[side]))
            nxt += 1
        out += rows
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch <= 16, ctx <= 2048, fewer iters")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_kernels: torch is not installed; nothing to measure")
        return []
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (none visible); nothing to measure")
        return []
    batches = [b for b in BATCHES if not args.quick or b <= 16]
    contexts = [c for c in CONTEXTS if not args.quick or c <= 2048]
    budget = torch.cuda.get_device_properties(0).total_memory // 4
    print(
        f"# {torch.cuda.get_device_name(0)}, fp16, H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} "
        f"S={BLOCK}; µs per call (KV Mtok/s)"
    )
    cols = ("bidir", "all_forward", "sdpa", "sdpa+gather")
    print(f"{'batch':>6} {'ctx':>6} " + " ".join(f"{c:>20}" for c in cols) + "  max_err")
    rows = []
    for ctx in contexts:
        for batch in batches:
            kv_bytes = 2 * 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2  # two layouts, K and V
            if kv_bytes > budget:
                continue
            row = bench_one(torch, batch, ctx, iters=10 if args.quick else 50)
            rows.append(row)
            cells = [f"{row['us'][c]:10.1f} ({batch * ctx / row['us'][c]:7.1f})" for c in cols]
            print(
                f"{batch:>6} {ctx:>6} "
                + " ".join(f"{c:>20}" for c in cells)
                + f"  {row['max_err_vs_ref']:.1e}"
            )
    print(json.dumps({"bench": "kernels", "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
