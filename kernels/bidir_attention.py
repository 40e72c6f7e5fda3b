"""Triton paged attention over a bidirectional block table (``BlockTable``).

The kernels walk each sequence's pieces in logical order and read a piece's slots by its
direction bit: offset ``o`` is slot ``o`` (direction 0) or ``S - 1 - o`` (direction 1), so one
block may serve an RT sequence from the left and a BE sequence from the right. A piece fits in
one block, so each piece is one masked tile of ``S`` slots; softmax is online (running max and
sum in float32). Nothing is gathered on the host.

* ``decode_attention``: one program per (sequence, KV head, split); the program's ``H // Hkv``
  query heads share each K/V tile (one ``tl.dot`` per tile). With ``num_splits > 1`` the pieces
  are cut into contiguous ranges (flash-decoding) and a second kernel merges the partial
  results by their log-sum-exp; ``None`` picks a split count that fills the GPU.
* ``extend_attention``: one program per (sequence, query head, tile of ``BLOCK_M`` queries);
  causal by logical position, pieces past the tile's last query are skipped.

Same contract as ``reference`` (same arguments, ``q``'s dtype out). The cache dtype must equal
``q``'s (fp16, bf16 or fp32); fp32 dots run in IEEE precision (no TF32). CPU tensors run only
in Triton's interpreter: set ``TRITON_INTERPRET=1`` before triton is first imported (triton
reads the switch once, as ``@triton.jit`` runs; slow: for tests). The ``all_forward`` baseline
is the same kernel on a table whose directions are all 0 (``block_table.forward_pieces``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from sgl_fair.kernels.block_table import BlockTable


@triton.jit
def _piece_step(
    q, K, V, blk, direction, off, length, pos, qpos, m_i, l_i, acc, j, d, dmask,
    kv_k, kv_v, stride_kb, stride_ks, stride_vb, stride_vs, sm_scale,
    BLOCK_S: tl.constexpr, DOT_PREC: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """One piece of a sequence, one online-softmax step: read its ``length`` slots by its
    direction bit (offset ``o`` -> slot ``o``, or ``S - 1 - o``), score them against ``q``
    (rows; with ``CAUSAL`` only positions ``pos + j <= qpos``), fold them into (m, l, acc).
    ``kv_k``/``kv_v``: the KV head's offset in K and V."""
    o = off + j
    slot = tl.where(direction == 0, o, BLOCK_S - 1 - o).to(tl.int64)
    tmask = j < length
    kmask = tmask[:, None] & dmask[None, :]
    k = tl.load(
        K + blk * stride_kb + slot[:, None] * stride_ks + kv_k + d[None, :], mask=kmask, other=0.0
    )
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * sm_scale
    visible = tmask[None, :]
    if CAUSAL:
        visible = visible & ((pos + j)[None, :] <= qpos[:, None])
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    pr = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    v = tl.load(
        V + blk * stride_vb + slot[:, None] * stride_vs + kv_v + d[None, :], mask=kmask, other=0.0
    )
    acc = acc * alpha[:, None] + tl.dot(
        pr.to(v.dtype).to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC
    )
    return m_new, l_i, acc


@triton.jit
def _decode_stage1(
    Q, K, V, Blocks, Dirs, Offs, Lens, NumPieces, MidO, MidLse,
    sm_scale, pieces_per_split,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    hi = tl.arange(0, BLOCK_H)
    hmask = hi < GROUP
    heads = kvh * GROUP + hi
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    n = tl.load(NumPieces + b)
    p0 = split * pieces_per_split
    p1 = tl.minimum(p0 + pieces_per_split, n)
    j = tl.arange(0, BLOCK_S)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    row = b * stride_tb
    for p in range(p0, p1):
        m_i, l_i, acc = _piece_step(
            q, K, V, tl.load(Blocks + row + p).to(tl.int64), tl.load(Dirs + row + p),
            tl.load(Offs + row + p), tl.load(Lens + row + p), 0, hi, m_i, l_i, acc, j, d, dmask,
            kvh * stride_kh, kvh * stride_vh, stride_kb, stride_ks, stride_vb, stride_vs,
            sm_scale, BLOCK_S, DOT_PREC, False,
        )  # fmt: skip
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(
        MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
        out.to(MidO.dtype.element_ty),
        mask=hmask[:, None] & dmask[None, :],
    )
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out, num_splits,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_rb, stride_rh,
    BLOCK_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_SPLITS)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # 0 for empty splits
    o = tl.load(
        MidO + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_rb + h * stride_rh + d, out.to(Out.dtype.element_ty), mask=dmask)


@triton.jit
def _extend(
    Q, K, V, Out, Blocks, Dirs, Offs, Lens, NumPieces, SeqLens, ExtLens, ExtStarts,
    sm_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_tb,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    ext = tl.load(ExtLens + b)
    qstart = tl.load(ExtStarts + b)
    seq_len = tl.load(SeqLens + b)
    n = tl.load(NumPieces + b)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < ext
    qpos = seq_len - ext + m
    # the tile's last query position; -1 (skip every piece) for a tile past this sequence's end
    qmax = seq_len - ext + tl.minimum((mb + 1) * BLOCK_M, ext) - 1
    qmax = tl.where(mb * BLOCK_M < ext, qmax, -1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qrow = (qstart + m).to(tl.int64)
    q = tl.load(
        Q + qrow[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=mmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    j = tl.arange(0, BLOCK_S)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pos = tl.full([], 0, tl.int32)  # logical position of the piece's first token
    row = b * stride_tb
    for p in range(0, n):
        length = tl.load(Lens + row + p)
        if pos <= qmax:
            # every row sees position 0 (in piece 0), so m is finite from the first piece
            m_i, l_i, acc = _piece_step(
                q, K, V, tl.load(Blocks + row + p).to(tl.int64), tl.load(Dirs + row + p),
                tl.load(Offs + row + p), length, pos, qpos, m_i, l_i, acc, j, d, dmask,
                kvh * stride_kh, kvh * stride_vh, stride_kb, stride_ks, stride_vb, stride_vs,
                sm_scale, BLOCK_S, DOT_PREC, True,
            )  # fmt: skip
        pos += length
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + qrow[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mmask[:, None] & dmask[None, :],
    )


# The interpreter is chosen when triton is imported (TRITON_INTERPRET=1), for every kernel at once.
INTERPRETED = type(_extend).__name__ == "InterpretedFunction"


def _kernel(fn, device: torch.device):
    """``fn``, after checking that it can run on ``device``."""
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); for CPU tensors set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    return fn


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: BlockTable):
    """(group size, block size, head dim, (dot precision, upcast)) after the checks."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported dtype {q.dtype}")
    _, s, hkv, d = k_cache.shape
    h = q.shape[-2]
    if q.shape[-1] != d or h % hkv:
        raise ValueError(f"query heads {h} x dim {q.shape[-1]} do not fit KV heads {hkv} x {d}")
    if s != table.block_size or s < 16 or s & (s - 1):
        raise ValueError(f"block size {s} (table: {table.block_size}) must be a power of 2 >= 16")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous (last, stride 1) dimension")
    if table.device != q.device or k_cache.device != q.device:
        raise ValueError("q, the caches and the table must be on one device")
    # The interpreter's tl.dot multiplies bf16 as raw integers: there, bf16 tiles go up to fp32
    # first (exact; bf16 products are exact in fp32, as on a GPU's bf16 MMA with fp32 sums).
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    return h // hkv, s, d, (prec, upcast)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_pieces: int, device: torch.device) -> int:
    """Enough splits that (sequences x KV heads x splits) programs fill the GPU twice over, with
    at least 4 pieces per split; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(2 * sms, max(batch * kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_pieces, 4), 64))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: BlockTable,
    sm_scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``q: [B, H, D]`` -> ``[B, H, D]``; see ``reference.decode_attention_ref``."""
    group, s, d, prec = _check(q, k_cache, v_cache, table)
    bsz, h, _ = q.shape
    if bsz != table.batch_size:
        raise ValueError(f"{bsz} queries for {table.batch_size} sequences")
    hkv = k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    p = table.max_pieces
    splits = num_splits or default_num_splits(bsz, hkv, p, q.device)
    splits = max(1, min(splits, p))
    per_split = triton.cdiv(p, splits)
    out = torch.empty_like(q)
    if splits == 1:  # stage 1 writes the output directly
        mid_o, mid_lse = out.unsqueeze(2), torch.empty(bsz, h, 1, device=q.device)
    else:
        mid_o = torch.empty(bsz, h, splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(bsz, h, splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    _kernel(_decode_stage1, q.device)[(bsz, hkv, splits)](
        q, k_cache, v_cache, table.blocks, table.dirs, table.offsets, table.lengths,
        table.num_pieces, mid_o, mid_lse,
        scale, per_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.blocks.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_S=s,
        HEAD_DIM=d, BLOCK_D=block_d, DOT_PREC=prec[0], DOT_F32=prec[1],
    )  # fmt: skip
    if splits > 1:
        _kernel(_decode_stage2, q.device)[(bsz, h)](
            mid_o, mid_lse, out, splits,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_SPLITS=triton.next_power_of_2(splits), HEAD_DIM=d, BLOCK_D=block_d,
        )  # fmt: skip
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: BlockTable,
    extend_lens: Sequence[int] | torch.Tensor,
    sm_scale: float | None = None,
    block_m: int = 32,
) -> torch.Tensor:
    """``q: [T, H, D]`` -> ``[T, H, D]``; see ``reference.extend_attention_ref``.

    A tensor ``extend_lens`` costs one device-to-host sync (the launch grid needs its max).
    """
    group, s, d, prec = _check(q, k_cache, v_cache, table)
    ext = torch.as_tensor(extend_lens, dtype=torch.int32).to(q.device)
    if ext.numel() != table.batch_size:
        raise ValueError(f"{ext.numel()} extend_lens for {table.batch_size} sequences")
    starts = torch.cumsum(ext, 0, dtype=torch.int32) - ext
    max_ext = int(ext.max()) if ext.numel() else 0
    out = torch.empty_like(q)
    if max_ext == 0:
        return out
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    grid = (table.batch_size, q.shape[1], triton.cdiv(max_ext, block_m))
    _kernel(_extend, q.device)[grid](
        q, k_cache, v_cache, out, table.blocks, table.dirs, table.offsets, table.lengths,
        table.num_pieces, table.seq_lens, ext, starts,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        table.blocks.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_S=s, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        DOT_PREC=prec[0], DOT_F32=prec[1],
    )  # fmt: skip
    return out
