"""Paged KV blocks: the vLLM-style allocator, on the block layout (``layout.py``) both block
allocators share.

The pool is cut into blocks of S = ``block_size`` slots. Each side of a block holds *pieces*:
runs of one owner's tokens, counted from that side's edge inward; an owner's pieces, in logical
order, are its KV. ``PagedAllocator`` uses the left side only::

    block 3  [ a a a a a a . . ]   a's last block: 2 slots of room, usable by a only
    block 7  [ C C C b b b b b ]   b handed its first 3 tokens to CACHE (a prefix commit)
    block 9  [ . . . . . . . . ]   free: any owner may take it

A growing owner fills the room after its last piece (while that piece is innermost on its
side), then takes whole free blocks, lowest id first. ``transfer`` re-labels the leading pieces,
splitting one at the boundary (block 7): no copy, no allocation, so ``PrefixKVCache.commit``
cannot fail on it. The price: once b leaves, block 7's empty slots are wasted until the cache
frees its three. Counting, the radix cache frees ``free(CACHE, n)``: CACHE's last n tokens
(a modelling choice). Exact (``PrefixKVCache(exact=True)``), it names the slots:
``free_slots(owner, flat_slots)`` frees exactly those (flat slot = block * S + slot) and
``flat_slots(owner)`` lists an owner's, in logical order.

Holes (a run freed from under a later piece) follow the layout's rule (``layout.py``).

Accounting: ``num_free_tokens`` counts whole free blocks only (free blocks × S), since only a
whole block can go to any owner; the empty slots of used blocks are internal fragmentation::

    capacity == num_free_tokens + Σ held(owner) + num_fragmented_tokens

Caveat: ``PrefixKVCache.can_allocate`` counts tokens (free + evictable); when evicting cached
tokens empties no whole block it can promise what this allocator then refuses (OutOfMemory).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from sgl_fair.worker.kv.base import OutOfMemory
from sgl_fair.worker.kv.layout import BlockLayout
from sgl_fair.worker.kv.registry import register_allocator

DEFAULT_BLOCK_SIZE = 16  # the BROS paper's §7.1 setting, for BROS, vLLM and RR alike


@dataclass(frozen=True)
class PagedConfig:
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_size must be an integer >= 1 (got {b!r})")


@register_allocator("paged")
class PagedAllocator:
    Config = PagedConfig

    def __init__(self, capacity_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.config = PagedConfig(block_size)
        self.layout = BlockLayout(capacity_tokens, block_size)
        self.block_size = block_size
        self.num_blocks = self.layout.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Whole blocks only: a remainder smaller than a block is never used."""
        return self.layout.capacity_tokens

    def num_free_tokens(self) -> int:
        return len(self.layout.free_blocks) * self.block_size

    def num_fragmented_tokens(self) -> int:
        """Empty slots inside used blocks (only the owner whose room they are may fill them)."""
        return self.layout.num_empty - self.num_free_tokens()

    def room(self, owner: Hashable) -> int:
        """Empty slots after ``owner``'s last piece that it alone may fill."""
        piece = self.layout.growable(owner, 0)
        return 0 if piece is None else self.layout.room(piece)

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool:
        return 0 <= num_tokens <= self.room(owner) + self.num_free_tokens()

    def can_allocate_after_free(
        self, owner: Hashable, num_tokens: int, freed: Hashable, k: int, *, slots=None
    ) -> bool:
        """``can_allocate`` once ``free(freed, k)`` has run (a dry run: nothing changes);
        ``slots``: once ``free_slots(freed, slots)`` has."""
        num_free = len(self.layout.free_blocks) + self.layout.blocks_freed_by(freed, k, slots)
        return 0 <= num_tokens <= self.room(owner) + num_free * self.block_size

    def allocate(self, owner: Hashable, num_tokens: int) -> None:
        layout = self.layout
        # A decode token: most often one more slot in the owner's room.
        if num_tokens == 1 and layout.extend_alone_each((owner,)) == 1:
            return
        piece = layout.growable(owner, 0)
        room = 0 if piece is None else layout.room(piece)
        if not 0 <= num_tokens <= room + self.num_free_tokens():
            raise OutOfMemory(
                f"need {num_tokens} tokens, {owner!r} has {room} slots of room "
                f"and {len(layout.free_blocks)} free blocks of {self.block_size}"
            )
        in_room = min(num_tokens, room)
        if in_room:
            layout.extend(piece, in_room)
        if num_tokens > in_room:
            layout.grow_fresh(owner, 0, num_tokens - in_room)  # whole free blocks

    def extend_in_room(self, owners: Sequence[Hashable], start: int = 0) -> int:
        """One token for each owner from ``start`` on, in its own room (no new block), in
        order; returns the index of the first owner that needs more (left unchanged). The
        optional decode fast path ``PrefixKVCache.allocate_each`` uses."""
        return self.layout.extend_alone_each(owners, start)

    def free(self, owner: Hashable, num_tokens: int | None = None) -> None:
        """Free ``owner``'s last ``num_tokens`` tokens (all when None); emptied blocks go back."""
        held = self.held(owner)
        n = held if num_tokens is None else num_tokens
        if n < 0 or n > held:
            raise ValueError(f"{owner!r} holds {held} tokens, cannot free {n}")
        while n:
            piece = self.layout.segs[owner][-1]
            k = min(n, piece.length)
            self.layout.shrink(piece, k)
            n -= k

    def enable_exact(self) -> None:
        """Exact mode (``SlotAllocator``): block slots are always exact; nothing to do."""

    def free_slots(self, owner: Hashable, flat_slots: Iterable[int]) -> None:
        """Free exactly these slots (``block * S + slot``) of ``owner`` (holes: module doc)."""
        self.layout.release_slots(owner, flat_slots)

    def flat_slots(self, owner: Hashable) -> list[int]:
        """``owner``'s slots (``block * S + slot``) in logical order."""
        return self.layout.flat_slots(owner)

    def transfer(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        """Hand ``src``'s first ``num_tokens`` tokens to ``dst`` (after dst's own), in place."""
        held = self.held(src)
        if num_tokens < 0 or num_tokens > held:
            raise ValueError(f"{src!r} holds {held} tokens, cannot transfer {num_tokens}")
        if num_tokens and src != dst:
            self.layout.hand_over(src, dst, num_tokens)

    def held(self, owner: Hashable) -> int:
        return self.layout.held.get(owner, 0)

    def owners(self) -> list[Hashable]:
        return list(self.layout.held)

    def block_table(self, owner: Hashable) -> list[int]:
        """``owner``'s blocks in logical order (what a paged-attention kernel reads)."""
        table: list[int] = []
        for piece in self.layout.pieces(owner):
            if not table or table[-1] != piece.block:
                table.append(piece.block)
        return table

    def check_invariants(self) -> None:
        layout = self.layout
        layout.check()
        assert all(not sides[1] for sides in layout.sides), "a paged block uses its right side"
        fragmented = sum(
            self.block_size - sum(p.length for p in sides[0]) for sides in layout.sides if sides[0]
        )
        total = self.num_free_tokens() + sum(layout.held.values()) + fragmented
        assert total == self.capacity_tokens, (
            f"free + held + fragmented = {total} != capacity {self.capacity_tokens}"
        )
