"""The spec: paged attention over a bidirectional block table, in plain torch.

Each sequence's K/V is gathered in logical order (``BlockTable.slot_indices``), then attended
to with a softmax in float32; the result has the query's dtype. GQA: ``H`` query heads share
``Hkv`` KV heads (``H % Hkv == 0``), query head ``h`` reads KV head ``h // (H // Hkv)``. The
scale defaults to ``1 / sqrt(head_dim)``.

* ``decode_attention_ref(q[B, H, D], ...)``: one new query per sequence, attending to all of its
  ``seq_lens[b]`` tokens (its own new token's KV already written).
* ``extend_attention_ref(q[T, H, D], ..., extend_lens)``: sequence b's ``extend_lens[b]``
  queries are its *last* ``extend_lens[b]`` logical positions, concatenated over the batch in
  order (``T = Σ extend_lens``); causal: the query at position p sees positions ``0..p``.

The Triton kernels (``bidir_attention``) must match these within the tolerances in
docs/kernels.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sgl_fair.kernels.block_table import BlockTable


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: BlockTable, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s K and V in logical order, ``[seq_len, Hkv, D]`` each (a copy)."""
    s = k_cache.shape[1]
    if s != table.block_size:
        raise ValueError(f"cache block size {s} != table block size {table.block_size}")
    flat = table.slot_indices(seq).to(k_cache.device)
    block, slot = flat // s, flat % s
    return k_cache[block, slot], v_cache[block, slot]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The GQA group size ``H // Hkv``, after shape checks."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    h, d = q.shape[-2:]
    hkv = k_cache.shape[2]
    if d != k_cache.shape[3] or h % hkv:
        raise ValueError(
            f"query heads {h} x dim {d} do not fit KV heads {hkv} x dim {k_cache.shape[3]}"
        )
    return h // hkv


def _attend(q, k, v, group, sm_scale, causal_from=None):
    """q [M, H, D], k/v [N, Hkv, D] -> [M, H, D] in float32; with ``causal_from`` = the logical
    position of q's first row, row m sees keys 0..causal_from + m."""
    q, k, v = q.float(), k.float(), v.float()
    k = k.repeat_interleave(group, dim=1)  # [N, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * sm_scale  # [H, M, N]
    if causal_from is not None:
        qpos = causal_from + torch.arange(q.shape[0], device=q.device)
        kpos = torch.arange(k.shape[0], device=q.device)
        scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hmn,nhd->mhd", probs, v)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: BlockTable,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """``q: [B, H, D]`` -> ``[B, H, D]``: each sequence's query over all its tokens."""
    group = _check(q, k_cache, v_cache)
    if q.shape[0] != table.batch_size:
        raise ValueError(f"{q.shape[0]} queries for {table.batch_size} sequences")
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(table.batch_size):
        k, v = gather_kv(k_cache, v_cache, table, b)
        if k.shape[0]:
            out[b] = _attend(q[b : b + 1], k, v, group, scale)[0]
    return out.to(q.dtype)


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: BlockTable,
    extend_lens: Sequence[int] | torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """``q: [T, H, D]`` (T = Σ extend_lens) -> ``[T, H, D]``, causal within each sequence."""
    group = _check(q, k_cache, v_cache)
    ext = [int(e) for e in extend_lens]
    if len(ext) != table.batch_size or sum(ext) != q.shape[0]:
        raise ValueError(
            f"extend_lens {ext} do not match {q.shape[0]} queries for {table.batch_size} sequences"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for b, n in enumerate(ext):
        k, v = gather_kv(k_cache, v_cache, table, b)
        if n > k.shape[0]:
            raise ValueError(f"sequence {b}: extend_len {n} > seq_len {k.shape[0]}")
        if n:
            qb = q[start : start + n]
            out[start : start + n] = _attend(qb, k, v, group, scale, causal_from=k.shape[0] - n)
        start += n
    return out.to(q.dtype)
