"""The room a new RT request can reach on bidirectional blocks, kept per block.

``BidirectionalAllocator.num_free_tokens_for(RT)`` counts free blocks, and the blocks without
a left (RT) run whose right (BE) runs an RT request may overwrite::

    a block with no left run and some right run:
        pinned = the end of its pinned right runs (CACHE, or BE requests pinned this step)
        full = S - pinned          (RT may overwrite every BE slot beyond the pinned ones)
        fallback = S - max end     (only its empty slots)
        it needs a host block when a BE run beyond ``pinned`` has no checkpoint yet;
        host blocks go to such blocks in block order; one without gets ``fallback``

The scheduler asks several times an iteration, and each decode token changes a block, so a
rescan of every block (``scan``, the reference) cost more than the rest of BROS's
iteration. ``RTRoom`` keeps each block's contribution and the sums, and recomputes only the
blocks the layout marked touched (``BlockLayout.touched``: a piece grew, shrank, moved or
changed hands) and those the allocator marks (a pin, a checkpoint): O(touched) a call, and
the first ``H`` needy blocks when host blocks are short. ``check_invariants`` compares it
with ``scan``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Hashable
from typing import Any

from sgl_fair.worker.kv.layout import Piece


class RTRoom:
    def __init__(self, layout: Any, pinned: Callable[[Hashable], bool]) -> None:
        self.layout = layout
        self.pinned = pinned
        self._blocks: dict[int, tuple[bool, int, int]] = {}  # block -> (needs host, full, fb)
        self._plain = 0  # Σ full over blocks that need no host block
        self._fallback = 0  # Σ fallback over blocks that need one ...
        self._gain = 0  # ... Σ (full - fallback) over them ...
        self._needy: list[int] = []  # ... and their ids, sorted

    def _block(self, b: int, skip: Hashable = None) -> tuple[bool, int, int] | None:
        left, right = self.layout.sides[b]
        if skip is not None:
            right = [p for p in right if p.owner != skip]
        if left or not right:
            return None
        size, pinned = self.layout.block_size, self.pinned
        top = max((p.end for p in right if pinned(p.owner)), default=0)
        needs = any(p.ckpt is None for p in right if p.end > top)
        return needs, size - top, size - max(p.end for p in right)

    def _rebuild(self) -> None:
        """Every block's contribution again (many touched: one pass beats many inserts)."""
        self._blocks.clear()
        self._plain = self._fallback = self._gain = 0
        needy = []
        for b in range(len(self.layout.sides)):
            new = self._block(b)
            if new is None:
                continue
            self._blocks[b] = new
            needs, full, fallback = new
            if needs:
                self._fallback += fallback
                self._gain += full - fallback
                needy.append(b)
            else:
                self._plain += full
        self._needy = needy  # in block order: already sorted
        self.layout.touched.clear()

    def _update(self) -> None:
        touched = self.layout.touched
        if len(touched) > 64 + len(self.layout.sides) // 16:
            self._rebuild()
            return
        blocks, needy = self._blocks, self._needy
        for b in touched:
            old = blocks.pop(b, None)
            if old is not None:
                needs, full, fallback = old
                if needs:
                    self._fallback -= fallback
                    self._gain -= full - fallback
                    del needy[bisect_left(needy, b)]
                else:
                    self._plain -= full
            new = self._block(b)
            if new is not None:
                blocks[b] = new
                needs, full, fallback = new
                if needs:
                    self._fallback += fallback
                    self._gain += full - fallback
                    insort(needy, b)
                else:
                    self._plain += full
        touched.clear()

    def value(self, host_left: int) -> int:
        """The room, with ``host_left`` free host blocks."""
        self._update()
        room = len(self.layout.free_blocks) * self.layout.block_size
        room += self._plain + self._fallback
        if host_left >= len(self._needy):
            return room + self._gain
        blocks = self._blocks
        return room + sum(blocks[b][1] - blocks[b][2] for b in self._needy[:host_left])

    def value_without(self, owner: Hashable, host_left: int) -> int:
        """The room if ``owner`` (a BE request) were dropped, its host blocks (counted in
        ``host_left`` by the caller) freed: only the blocks it holds change."""
        self._update()
        layout, size, blocks = self.layout, self.layout.block_size, self._blocks
        room = len(layout.free_blocks) * size + self._plain + self._fallback
        gain_all, num_needy = self._gain, len(self._needy)  # as if every needy block got one
        changed: dict[int, tuple[bool, int, int] | None] = {}
        for piece in layout.segs.get(owner, ()):
            if not isinstance(piece, Piece) or piece.block in changed:
                continue  # a host copy, or a block seen
            b = piece.block
            old = blocks.get(b)
            if old is not None:
                room -= old[2] if old[0] else old[1]
                if old[0]:
                    gain_all -= old[1] - old[2]
                    num_needy -= 1
            left, right = layout.sides[b]
            if not left and all(p.owner == owner for p in right):
                room += size  # the block empties
                changed[b] = None
                continue
            new = changed[b] = self._block(b, skip=owner)
            if new is not None:
                room += new[2] if new[0] else new[1]
                if new[0]:
                    gain_all += new[1] - new[2]
                    num_needy += 1
        if host_left >= num_needy:  # host blocks for every needy block: no order to walk
            return room + gain_all
        needy = [b for b in self._needy if b not in changed]
        needy += [b for b, new in changed.items() if new is not None and new[0]]
        needy.sort()
        gain = 0
        for b in needy[:host_left]:
            needs, full, fallback = changed[b] if b in changed else blocks[b]
            gain += full - fallback
        return room + gain

    def scan(self, host_left: int) -> int:
        """The same room, from a scan of every block (the reference)."""
        size, pinned = self.layout.block_size, self.pinned
        room = len(self.layout.free_blocks) * size
        for left, right in self.layout.sides:
            if left or not right:
                continue
            top = max((p.end for p in right if pinned(p.owner)), default=0)
            if any(p.ckpt is None for p in right if p.end > top):
                if not host_left:
                    room += size - max(p.end for p in right)
                    continue
                host_left -= 1
            room += size - top
        return room
