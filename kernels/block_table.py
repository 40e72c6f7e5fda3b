"""A batch's bidirectional block table: each sequence's KV as pieces, padded into int32 tensors.

The KV cache is ``k_cache, v_cache: [num_blocks, S, num_kv_heads, head_dim]`` (S = block size).
A *piece* is ``(block, direction, offset, length)``: ``length`` consecutive logical tokens in one
block, counted ``offset`` slots in from one side's edge. Direction 0 (RT) reads left→right, so
offset ``o`` is slot ``o``; direction 1 (BE) reads right→left, so offset ``o`` is slot
``S - 1 - o``. A sequence's pieces, in order, are its tokens in logical order::

    slot      0  1  2  3  4  5  6  7                     (S = 8)
    block 5 [ C0 C1 r0 r1 .  b2 b1 b0 ]   r: (5, 0, 0, 2) for C, then (5, 0, 2, 2) its own
                                          b: (5, 1, 0, 3)  (b0 at slot 7, b2 at slot 5)

``offset`` is non-zero when the piece follows another owner's run on the same side (here the
cached prefix C0 C1 that r reuses: r's logical tokens are C0 C1 r0 r1). ``BlockTable`` pads the
per-sequence lists to ``P`` pieces (padding: zeros, length 0); kernels read ``num_pieces[b]``.
This mirrors ``sgl_fair.worker.kv.paged.Piece`` (``side`` = direction, ``start`` = offset)
without importing it: kernels is a layer-1 package.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PieceTuple = tuple[int, int, int, int]  # (block, direction, offset, length)
LEFT, RIGHT = 0, 1  # directions: RT fills from the left edge, BE from the right


@dataclass(frozen=True)
class BlockTable:
    """Padded int32 tensors, one row per sequence, on one device."""

    blocks: torch.Tensor  # [B, P]
    dirs: torch.Tensor  # [B, P]  0: left→right, 1: right→left
    offsets: torch.Tensor  # [B, P]  first used offset from that side's edge
    lengths: torch.Tensor  # [B, P]  tokens in the piece (0 in padding)
    num_pieces: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]   Σ lengths
    block_size: int
    max_seq_len: int  # host copy of max(seq_lens), for launch grids

    @property
    def batch_size(self) -> int:
        return self.blocks.shape[0]

    @property
    def max_pieces(self) -> int:
        return self.blocks.shape[1]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @classmethod
    def from_pieces(
        cls,
        pieces: Sequence[Sequence[PieceTuple]],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> BlockTable:
        """One list of ``(block, direction, offset, length)`` per sequence, in logical order.

        Zero-length pieces are dropped; a piece must fit its block (``offset + length <= S``).
        """
        rows = []
        for i, seq in enumerate(pieces):
            row = []
            for p in seq:
                block, direction, offset, length = (int(x) for x in p)
                if direction not in (LEFT, RIGHT):
                    raise ValueError(f"sequence {i}: direction must be 0 or 1 (got {direction})")
                if block < 0 or offset < 0 or length < 0 or offset + length > block_size:
                    raise ValueError(
                        f"sequence {i}: piece {tuple(p)} does not fit a block of {block_size} slots"
                    )
                if length:
                    row.append((block, direction, offset, length))
            rows.append(row)
        width = max([len(r) for r in rows] + [1])
        pad = [r + [(0, 0, 0, 0)] * (width - len(r)) for r in rows]
        cols = torch.tensor(pad, dtype=torch.int32).reshape(len(rows), width, 4)
        seq_lens = [sum(p[3] for p in r) for r in rows]
        return cls(
            blocks=cols[:, :, 0].contiguous().to(device),
            dirs=cols[:, :, 1].contiguous().to(device),
            offsets=cols[:, :, 2].contiguous().to(device),
            lengths=cols[:, :, 3].contiguous().to(device),
            num_pieces=torch.tensor([len(r) for r in rows], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_size=block_size,
            max_seq_len=max(seq_lens, default=0),
        )

    def pieces(self, seq: int) -> list[PieceTuple]:
        """Sequence ``seq``'s pieces, as host tuples (padding dropped)."""
        n = int(self.num_pieces[seq])
        cols = [t[seq, :n].tolist() for t in (self.blocks, self.dirs, self.offsets, self.lengths)]
        return list(zip(*cols, strict=True))

    def slot_indices(self, seq: int) -> torch.Tensor:
        """Flat slot ``block * S + slot`` of each of ``seq``'s tokens in logical order (int64,
        on the table's device): index ``k_cache.view(-1, Hkv, D)`` to gather, or ``write_kv``."""
        s = self.block_size
        out = []
        for block, direction, offset, length in self.pieces(seq):
            offs = torch.arange(offset, offset + length)
            out.append(block * s + (offs if direction == LEFT else s - 1 - offs))
        flat = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)
        return flat.to(self.device)

    def to(self, device: str | torch.device) -> BlockTable:
        cols = (self.blocks, self.dirs, self.offsets, self.lengths, self.num_pieces, self.seq_lens)
        return BlockTable(*(t.to(device) for t in cols), self.block_size, self.max_seq_len)

    def num_blocks_used(self) -> int:
        """1 + the highest block id any piece reads (a cache must have at least that many)."""
        used = self.lengths > 0
        return int(self.blocks[used].max()) + 1 if bool(used.any()) else 0


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    flat_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new tokens' ``k, v: [N, Hkv, D]`` at ``flat_slots: [N]`` (``slot_indices``), in place;
    works for any cache strides."""
    s = k_cache.shape[1]
    flat = flat_slots.to(device=k_cache.device, dtype=torch.int64)
    block, slot = flat // s, flat % s
    k_cache[block, slot] = k.to(k_cache.dtype)
    v_cache[block, slot] = v.to(v_cache.dtype)


def forward_pieces(seq_lens: Sequence[int], block_size: int, first_block: int = 0):
    """Each sequence in its own fresh blocks, all read left→right (full blocks, then a partial
    one): the classic paged layout, e.g. the ``all_forward`` baseline of the same token counts."""
    out, nxt = [], first_block
    for n in seq_lens:
        row = []
        for start in range(0, n, block_size):
            row.append((nxt, LEFT, 0, min(block_size, n - start)))
            nxt += 1
        out.append(row)
    return out, nxt


def bidirectional_pieces(
    seq_lens: Sequence[int],
    block_size: int,
    seed: int = 0,
    prefix_len: int = 0,
    share: float = 0.5,
):
    """A random BROS-like layout of ``seq_lens`` tokens; returns ``(pieces, num_blocks)``.

    Each sequence is RT (left side) or BE (right side) at random; a new piece goes, with
    probability ``share``, into a block whose own side is empty but that the other side uses (an
    RT and a BE sequence share it), else into a fresh block; the last block is usually partial.
    With ``prefix_len > 0`` a CACHE owner first holds a prefix of that many tokens and every
    other sequence (odd index) longer than the prefix starts with the cache's pieces; the first
    of those is on the cache's side and continues in the cache's last block, at a non-zero
    offset when the prefix is not a whole number of blocks. For tests and benchmarks.
    """
    rng = random.Random(seed)
    s = block_size
    fill: list[list[int]] = []  # per block: [left run end, right run end]

    def place(row: list, side: int, n: int, own: bool) -> None:
        while n > 0:
            last = row[-1] if row else None
            if last is not None and last[1] == side and fill[last[0]][side] == last[2] + last[3]:
                b = last[0]  # the last piece is innermost on this side: continue in its block
            else:
                b = None
            if b is None or s - sum(fill[b]) == 0:
                shared = [
                    i for i, f in enumerate(fill) if f[side] == 0 and f[1 - side] and sum(f) < s
                ]
                if shared and rng.random() < share:
                    b = rng.choice(shared)
                else:
                    fill.append([0, 0])
                    b = len(fill) - 1
            take = min(n, s - sum(fill[b]))
            if own and last is not None and last[0] == b and last[1] == side and last[4]:
                last[3] += take  # grow my own piece
            else:
                row.append([b, side, fill[b][side], take, own])
            fill[b][side] += take
            n -= take

    cache: list = []
    cache_side = rng.randrange(2)
    if prefix_len > 0:
        place(cache, cache_side, prefix_len, own=False)
    out, sharers = [], 0
    for i, n in enumerate(seq_lens):
        side = rng.randrange(2)
        row: list = []
        if prefix_len > 0 and i % 2 == 1 and n > prefix_len:
            # the first sharer (the request the prefix came from) stays on the cache's side and
            # continues in the cache's last block, at a non-zero offset if that has room
            row, n = [list(p) for p in cache], n - prefix_len
            side = cache_side if sharers == 0 else side
            sharers += 1
        place(row, side, n, own=True)
        out.append([tuple(p[:4]) for p in row if p[3] > 0])
    return out, len(fill)


def pieces_from_slots(flat_slots: Sequence[int], block_size: int) -> list[PieceTuple]:
    """The pieces ``(block, direction, offset, length)`` of one sequence whose tokens, in
    logical order, are at ``flat_slots`` (``block * S + slot``): each maximal run of slots
    that rise by one inside a block is a direction-0 piece, each run that falls by one is a
    direction-1 piece (a lone slot is direction 0). The inverse of ``slot_indices``."""
    s = block_size
    out: list[PieceTuple] = []
    i, n = 0, len(flat_slots)
    while i < n:
        block, first = divmod(int(flat_slots[i]), s)
        j, step = i + 1, 0
        if j < n and int(flat_slots[j]) // s == block:
            step = int(flat_slots[j]) - int(flat_slots[i])
            step = step if step in (1, -1) else 0
        if step:
            while (
                j < n
                and int(flat_slots[j]) - int(flat_slots[j - 1]) == step
                and (int(flat_slots[j]) // s == block)
            ):
                j += 1
        if step == -1:
            out.append((block, RIGHT, s - 1 - first, j - i))
        else:
            j = i + 1 if step == 0 else j
            out.append((block, LEFT, first, j - i))
        i = j
    return out
