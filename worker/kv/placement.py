"""Where a bidirectional allocation would go: the placement plan, with no side effects.

``plan`` gives the grants (block, slots) in placement order for ``need`` more tokens of an
owner, as if the owners in ``skip`` were dropped (``victims_for`` asks it that way), or None;
``BidirectionalAllocator.allocate`` carries a plan out. The rules are the allocator's
(``bidirectional.py``): BE takes its room, then the emptiest blocks with an empty right side;
RT its room, free blocks, the BE slots of its last block, then preempts blocks without a left
run, the emptiest first, overwriting BE slots innermost first while host blocks last.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Any

from sgl_fair.worker.kv.layout import Piece

RT, BE = "rt", "be"
LEFT, RIGHT = 0, 1  # a block's sides, and the direction bit the kernel reads each with
SIDE = {RT: LEFT, BE: RIGHT}


def plan(alloc: Any, owner: Hashable, cls: str, need: int, skip: frozenset = frozenset()):
    """Grants for ``need`` more tokens of ``owner``, as if ``skip`` were dropped; or None."""
    if need <= 0 or (cls == BE and alloc.checkpointed_slots(owner)):
        return [] if need == 0 else None  # checkpointed BE: restore before it runs again
    layout, size, side = alloc.layout, alloc.block_size, SIDE[cls]
    grants: list[tuple[int, int]] = []  # (block, slots), in placement order
    cur = layout.growable(owner, side, skip)
    if cur is not None and (k := min(need, layout.room(cur, skip))):
        grants.append((cur.block, k))
        need -= k
    if side == RIGHT:
        fresh = layout.fresh(RIGHT, need, skip)
        return None if fresh is None else grants + fresh
    free_ids = layout.free_ids(-(-need // size), skip)
    for block in free_ids:
        grants.append((block, min(need, size)))
        need -= grants[-1][1]
    if not need:
        return grants
    host_left = alloc.num_free_host_blocks()
    host_left += sum(not isinstance(s, Piece) for o in skip for s in layout.segs.get(o, ()))
    taken = set(free_ids)
    if cur is not None:
        taken.add(cur.block)
        if not free_ids:  # still its last block: grow into the BE slots there first
            pos = size - layout.end(cur.block, RIGHT, skip)  # its run meets BE's
            got, used = reach(alloc, cur.block, pos, need, host_left, skip)
            if got:
                grants.append((cur.block, got))
                need -= got
                host_left -= used
            if not need:
                return grants
    # Preempt: blocks without a left run, the most empty slots first (usually the first
    # one or two do): the layout's kept order, or a heap of the what-if layout.
    if skip:
        blocks = [
            (layout.end(b, RIGHT, skip), b)
            for b, (_, right) in enumerate(layout.sides)
            if right and b not in taken and not layout.end(b, LEFT, skip)
        ]
        heapq.heapify(blocks)
        ordered = (heapq.heappop(blocks)[1] for _ in range(len(blocks)))
    else:  # ends of 0 are free blocks: none left, or free_ids above took them
        ordered = (b for end, b in layout.emptiest(LEFT) if end and b not in taken)
    for block in ordered:
        got, used = reach(alloc, block, 0, need, host_left, skip)
        if got:
            grants.append((block, got))
            need -= got
            host_left -= used
        if not need:
            return grants
    return None


def reach(alloc: Any, block: int, pos: int, need: int, host_left: int, skip: frozenset):
    """Slots (<= need) an RT run ending at slot ``pos`` can take in ``block``, overwriting
    BE slots innermost first while host blocks last -> (slots, new host blocks used)."""
    size, got, used = alloc.block_size, 0, 0
    right = [p for p in alloc.layout.sides[block][RIGHT] if p.owner not in skip]
    for piece in sorted(right, key=lambda p: -p.end):  # innermost (newest) first
        gap = size - piece.end - pos
        if need - got <= gap:
            return need, used
        got += gap
        if alloc._pinned(piece.owner) or (piece.ckpt is None and used == host_left):
            return got, used  # pinned, or nowhere to checkpoint it
        used += piece.ckpt is None
        if need - got <= piece.length:
            return need, used
        got += piece.length
        pos = size - piece.start
    return min(need, got + size - pos), used
