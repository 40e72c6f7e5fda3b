"""The block layout both block allocators share (``paged``, ``bidirectional``): who holds
which slots.

The pool is cut into blocks of S = ``block_size`` slots. Each side of a block holds *pieces*:
runs of one owner's tokens, counted from that side's edge inward; an owner's pieces, in logical
order, are its KV (the allocators' module docstrings draw examples).

Holes: freeing a run that is not innermost on its side (a request's duplicated *leading*
tokens, a cached prefix evicted from under a later piece) leaves empty slots below a piece.
Rule: placement only ever starts at a side's innermost end (``end``), so a hole is never
filled; it is internal fragmentation until the pieces beyond it go (then ``end`` drops and the
hole is room again). Pieces may thus start at any offset; every count stays exact.

Kept orders: ``emptiest(side)`` (the blocks a new run on a side may take, most empty first) is
kept sorted and re-placed per block from ``touched`` blocks, as the bidirectional RT room
(``rt_room.py``) is; ``check`` compares both with a rescan.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

NO_ONE: frozenset = frozenset()


@dataclass(eq=False)  # identity semantics: pieces are found in lists with `is` / `remove`
class Piece:
    """One owner's tokens on one side of a block: offsets [start, end) from that side's edge."""

    owner: Hashable
    block: int
    side: int  # 0: from the left edge (read left→right), 1: from the right edge
    start: int
    length: int
    ckpt: Any = None  # bidirectional only: the host copy of its overwritten inner slots

    @property
    def end(self) -> int:
        return self.start + self.length


class BlockLayout:
    """Who holds which slots: pieces per block side, and per owner in logical order.

    An owner's list may also hold segments that are not pieces (the bidirectional allocator's
    host checkpoints); the layout leaves those to their allocator. ``skip``: owners to treat as
    gone (what-if planning for victims).
    """

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        if self.num_blocks < 1:
            raise ValueError(
                f"KV capacity must hold >= 1 block of {block_size} tokens (got {capacity_tokens})"
            )
        self.free_blocks = set(range(self.num_blocks))
        # The free ids again, as a min-heap with lazy deletion (stale ids are dropped when
        # they surface): the lowest free ids in O(k log n), not a scan of every free block.
        self._free_heap = list(range(self.num_blocks))
        self.sides: list[tuple[list[Piece], list[Piece]]] = [
            ([], []) for _ in range(self.num_blocks)
        ]
        self.segs: dict[Hashable, list] = {}
        self.held: dict[Hashable, int] = {}
        self.num_empty = self.num_blocks * block_size
        # Blocks whose pieces changed, for a consumer that keeps per-block state (the
        # bidirectional allocator's RT room drains it); at most every block id.
        self.touched: set[int] = set()
        # ``fresh``'s order per side, kept per block: (other side's end, block) for each block
        # whose side is empty, sorted; synced from the blocks touched since (``_order_sync``).
        every = list(range(self.num_blocks))
        self._order: tuple[list, list] = ([(0, b) for b in every], [(0, b) for b in every])
        self._order_at: tuple[dict, dict] = (dict.fromkeys(every, 0), dict.fromkeys(every, 0))
        self._order_touched: set[int] = set()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def pieces(self, owner: Hashable) -> list[Piece]:
        return [p for p in self.segs.get(owner, ()) if isinstance(p, Piece)]

    def slot(self, piece: Piece, off: int) -> tuple[int, int]:
        return piece.block, off if piece.side == 0 else self.block_size - 1 - off

    def slot_mapping(self, owner: Hashable) -> list[tuple[int, int]]:
        """(block, slot) of each of ``owner``'s tokens in its pieces, in logical order."""
        return [self.slot(p, off) for p in self.pieces(owner) for off in range(p.start, p.end)]

    def end(self, block: int, side: int, skip: frozenset = NO_ONE) -> int:
        pieces = self.sides[block][side]
        if not skip and len(pieces) < 2:  # the usual cases: one run on a side, or none
            return pieces[0].end if pieces else 0
        return max((p.end for p in pieces if p.owner not in skip), default=0)

    def growable(self, owner: Hashable, side: int, skip: frozenset = NO_ONE) -> Piece | None:
        """``owner``'s last segment if it is a piece on ``side``, innermost there (may grow)."""
        segs = self.segs.get(owner)
        last = segs[-1] if segs else None
        if isinstance(last, Piece) and last.side == side:
            return last if last.end == self.end(last.block, side, skip) else None
        return None

    def room(self, piece: Piece, skip: frozenset = NO_ONE) -> int:
        """Empty slots between an innermost ``piece`` and the other side's run."""
        return self.block_size - piece.end - self.end(piece.block, 1 - piece.side, skip)

    def free_ids(self, k: int, skip: frozenset = NO_ONE, taken: set | frozenset = NO_ONE):
        """The ``k`` lowest free block ids not in ``taken`` (fewer if there are not as many)."""
        if k <= 0:
            return []
        if not skip:
            return self._lowest_free(k, taken)
        pool = self.free_blocks | {  # blocks only skipped owners use would be free too
            p.block
            for o in skip
            for p in self.pieces(o)
            if all(q.owner in skip for q in self.sides[p.block][0] + self.sides[p.block][1])
        }
        return heapq.nsmallest(k, pool - taken if taken else pool)

    def _lowest_free(self, k: int, taken: set | frozenset, keep: bool = True) -> list[int]:
        heap, free = self._free_heap, self.free_blocks
        if len(heap) > 2 * self.num_blocks + 64:  # mostly stale: rebuild
            heap[:] = sorted(free)
        out: list[int] = []
        aside: list[int] = []  # free but taken: they go back
        last = -1
        while heap and len(out) < k:
            block = heapq.heappop(heap)
            if block == last or block not in free:
                continue  # a duplicate (freed twice since it surfaced) or stale
            last = block
            (aside if block in taken else out).append(block)
        for block in out + aside if keep else aside:  # not keep: the caller takes `out`
            heapq.heappush(heap, block)
        return out

    def fresh(self, side: int, need: int, skip: frozenset = NO_ONE, taken: set = NO_ONE):
        """[(block, slots)] for a new run of ``need`` tokens on ``side``: blocks whose ``side`` is
        empty, most empty slots first (so free blocks first, lowest id first); None: no room."""
        size = self.block_size
        grants = [(b, size) for b in self.free_ids(-(-need // size), skip, taken)]
        left = need - size * len(grants)
        if left > 0:  # every free block is taken: partly used ones too, emptiest first
            used = taken | {b for b, _ in grants}
            if skip:
                others = sorted(
                    (self.end(b, 1 - side, skip), b)
                    for b in range(self.num_blocks)
                    if b not in used and not self.end(b, side, skip)
                )
            else:
                others = self.emptiest(side)
            for other, b in others:
                if other >= size or left <= 0:
                    break  # the rest are full too, or the need is met
                if b in used:
                    continue
                grants.append((b, size - other))
                left -= size - other
        out: list[tuple[int, int]] = []
        for block, room in grants:
            if need:
                out.append((block, min(need, room)))
                need -= out[-1][1]
        return None if need else out

    def _touch(self, block: int) -> None:
        self.touched.add(block)
        self._order_touched.add(block)

    def emptiest(self, side: int) -> list[tuple[int, int]]:
        """(other side's end, block) for every block whose ``side`` is empty, most empty
        slots first (free blocks first, lowest id first). Kept sorted: asked per allocation,
        only the blocks touched since are re-placed. Read it, never change it."""
        self._order_sync()
        return self._order[side]

    def _order_sync(self) -> None:
        touched = self._order_touched
        if len(touched) > 64 + self.num_blocks // 16:  # many: one sort beats many inserts
            self._order_rebuild()
            return
        for b in touched:
            sides = self.sides[b]
            for side in (0, 1):
                at, order = self._order_at[side], self._order[side]
                old = at.pop(b, None)
                if old is not None:
                    del order[bisect_left(order, (old, b))]
                if not sides[side]:
                    other = sides[1 - side]
                    end = max(p.end for p in other) if other else 0
                    at[b] = end
                    insort(order, (end, b))
        touched.clear()

    def _order_rebuild(self) -> None:
        """Both orders from a scan of every block (O(n log n))."""
        for side in (0, 1):
            at = {}
            for b, sides in enumerate(self.sides):
                if not sides[side]:
                    other = sides[1 - side]
                    at[b] = max(p.end for p in other) if other else 0
            self._order_at[side].clear()
            self._order_at[side].update(at)
            self._order[side][:] = sorted((end, b) for b, end in at.items())
        self._order_touched.clear()

    def new_piece(self, owner: Hashable, block: int, side: int, k: int) -> Piece:
        """A piece of ``k`` slots after ``block``'s run on ``side``; the caller files it."""
        piece = Piece(owner, block, side, self.end(block, side), 0)
        self.free_blocks.discard(block)
        self.sides[block][side].append(piece)
        self.extend(piece, k)
        return piece

    def grow(self, owner: Hashable, side: int, block: int, k: int) -> Piece:
        """``k`` more slots for ``owner`` in ``block``: its growable piece there, or a new one."""
        piece = self.growable(owner, side)
        if piece is not None and piece.block == block:
            self.extend(piece, k)
            return piece
        piece = self.new_piece(owner, block, side, k)
        self.segs.setdefault(owner, []).append(piece)
        return piece

    def extend_alone_each(self, owners: Sequence[Hashable], start: int = 0) -> int:
        """``extend(last, 1)`` for each owner from ``start`` on whose last segment is a piece
        alone on the left of its block, with the right side empty and a slot to spare (a
        paged decode token in its own room), in order. Returns the index of the first owner
        that is not so; nothing changes for it or the owners after it. One loop for a whole
        decode batch: the common case costs no call per owner."""
        segs, sides, held, size = self.segs, self.sides, self.held, self.block_size
        touched, order_touched = self.touched, self._order_touched
        for i in range(start, len(owners)):
            owner = owners[i]
            mine = segs.get(owner)
            last = mine[-1] if mine else None
            if not isinstance(last, Piece) or last.side:
                return i
            block = last.block
            left, right = sides[block]
            if len(left) != 1 or right or last.start + last.length >= size:
                return i
            touched.add(block)  # what `extend` does, inline
            order_touched.add(block)
            last.length += 1
            held[owner] += 1  # the owner holds this piece's tokens: present in `held`
            self.num_empty -= 1
        return len(owners)

    def grow_fresh(self, owner: Hashable, side: int, need: int) -> None:
        """``need`` tokens for ``owner`` in whole free blocks (the caller checked they cover
        it), the lowest ids first: a new piece in each, made in one loop, the blocks taken off
        the free heap for good (a prompt's blocks at admission)."""
        size = self.block_size
        ids = self._lowest_free(-(-need // size), NO_ONE, keep=False)
        if len(ids) * size < need:  # a caller's bug: put the ids back before saying so
            for block in ids:
                heapq.heappush(self._free_heap, block)
            raise ValueError(f"{need} tokens need {-(-need // size)} free blocks, {len(ids)} left")
        mine = self.segs.setdefault(owner, [])
        free, sides = self.free_blocks, self.sides
        touched, order_touched = self.touched, self._order_touched
        for i, block in enumerate(ids):
            piece = Piece(owner, block, side, 0, min(size, need - i * size))
            free.discard(block)
            sides[block][side].append(piece)
            touched.add(block)
            order_touched.add(block)
            mine.append(piece)
        bump(self.held, owner, need)
        self.num_empty -= need

    def extend(self, piece: Piece, k: int) -> None:
        self._touch(piece.block)
        piece.length += k
        bump(self.held, piece.owner, k)
        self.num_empty -= k

    def shrink(self, piece: Piece, k: int) -> None:
        """Release ``piece``'s ``k`` innermost slots; an emptied piece leaves every list."""
        self.extend(piece, -k)
        if piece.length:
            return
        segs, sides = self.segs[piece.owner], self.sides[piece.block]
        segs.remove(piece)
        if not segs:
            del self.segs[piece.owner]
        sides[piece.side].remove(piece)
        if not sides[0] and not sides[1]:
            self.free_blocks.add(piece.block)
            heapq.heappush(self._free_heap, piece.block)

    def blocks_freed_by(self, owner: Hashable, n: int, slots: list[int] | None = None) -> int:
        """Blocks that ``free(owner, n)`` (its last ``n`` tokens) would empty; no side effects.
        ``slots``: ``free_slots(owner, slots)`` instead (exact: slots ``owner`` holds)."""
        if slots is not None:
            sides = self.sides
            per_block = Counter(flat // self.block_size for flat in slots)
            return sum(
                k == sum(p.length for p in (*sides[b][0], *sides[b][1]))
                for b, k in per_block.items()
            )
        gone: set[int] = set()
        for seg in reversed(self.segs.get(owner, ())):
            if n <= 0:
                break
            if isinstance(seg, Piece) and seg.length <= n:
                gone.add(id(seg))
            n -= seg.length
        blocks = {p.block for p in self.segs.get(owner, ()) if id(p) in gone}
        sides = self.sides
        return sum(all(id(q) in gone for q in (*sides[b][0], *sides[b][1])) for b in blocks)

    def flat_slots(self, owner: Hashable) -> list[int]:
        """``owner``'s resident slots as ``block * S + slot``, in logical order."""
        size = self.block_size
        return [b * size + s for b, s in self.slot_mapping(owner)]

    def release_slots(self, owner: Hashable, flat_slots) -> None:
        """Free exactly ``flat_slots`` of ``owner``'s pieces (the module docstring's holes):
        a piece loses its inner end (``shrink``), its outer end, or a middle run (split in
        two; a checkpoint continues the inner part)."""
        size, runs = self.block_size, {}
        for flat in flat_slots:
            block, slot = divmod(flat, size)
            hit = None
            if 0 <= block < self.num_blocks:
                for side, off in ((0, slot), (1, size - 1 - slot)):
                    for p in self.sides[block][side]:
                        if p.owner == owner and p.start <= off < p.end:
                            hit = p, off
            if hit is None:
                raise ValueError(f"{owner!r} holds no resident slot {flat}")
            runs.setdefault(id(hit[0]), (hit[0], []))[1].append(hit[1])
        for piece, offs in runs.values():
            offs.sort()
            if len(set(offs)) != len(offs):
                raise ValueError(f"slot freed twice in {piece}")
            hi = len(offs)
            while hi:  # contiguous runs [offs[lo], offs[hi - 1]], innermost first
                lo = hi - 1
                while lo and offs[lo - 1] == offs[lo] - 1:
                    lo -= 1
                self._cut(piece, offs[lo], offs[hi - 1] + 1)
                hi = lo

    def _cut(self, piece: Piece, a: int, b: int) -> None:
        """Free offsets [a, b) of ``piece``."""
        if b == piece.end:  # its inner end: plain shrink
            ckpt = piece.ckpt
            self.shrink(piece, b - a)
            if not piece.length and ckpt is not None:
                ckpt.piece = piece.ckpt = None
        elif a == piece.start:  # its outer end: a hole below the rest
            piece.start = b
            self.extend(piece, a - b)
        else:  # a middle run: the inner part becomes a piece (the checkpoint continues it)
            inner = Piece(piece.owner, piece.block, piece.side, b, piece.end - b, piece.ckpt)
            if inner.ckpt is not None:
                inner.ckpt.piece, piece.ckpt = inner, None
            segs = self.segs[piece.owner]
            segs.insert(next(i for i, s in enumerate(segs) if s is piece) + 1, inner)
            self.sides[piece.block][piece.side].append(inner)
            self._touch(piece.block)
            piece.length = a - piece.start
            bump(self.held, piece.owner, a - b)
            self.num_empty += b - a

    def hand_over(self, src: Hashable, dst: Hashable, n: int) -> None:
        """Re-label ``src``'s first ``n`` tokens (all in leading pieces) as ``dst``'s, in place."""
        segs, dst_segs = self.segs[src], self.segs.setdefault(dst, [])
        rest = n
        while rest:
            piece = segs[0]
            if piece.length <= rest:
                segs.pop(0)
                piece.owner, moved = dst, piece
            else:  # split: the outer (older) part goes, the inner part stays
                moved = Piece(dst, piece.block, piece.side, piece.start, rest)
                piece.start += rest
                piece.length -= rest
                self.sides[piece.block][piece.side].append(moved)
            rest -= moved.length
            self._touch(moved.block)
            last = dst_segs[-1] if dst_segs else None
            where = (moved.block, moved.side, moved.start)
            if isinstance(last, Piece) and (last.block, last.side, last.end) == where:
                last.length += moved.length  # contiguous: one piece, not two
                self.sides[moved.block][moved.side].remove(moved)
            else:
                dst_segs.append(moved)
        bump(self.held, src, -n)
        bump(self.held, dst, n)
        if not segs:
            del self.segs[src]

    def check(self) -> None:
        """No slot owned twice; lists, counters and the free set agree; runs never overlap;
        ``fresh``'s kept order is what a rescan gives."""
        self._order_sync()
        sides = self.sides
        for side in (0, 1):
            ids = [b for b in range(len(sides)) if not sides[b][side]]
            again = sorted((self.end(b, 1 - side), b) for b in ids)
            assert self._order[side] == again, f"stale fresh() order, side {side}"
        size, claimed = self.block_size, set()
        for owner, segs in self.segs.items():
            assert segs and all(s.owner == owner and s.length > 0 for s in segs), owner
            pieces = self.pieces(owner)
            for p in pieces:
                assert p.start >= 0 and p.end <= size, f"bad piece {p}"
                assert any(q is p for q in self.sides[p.block][p.side]), f"{p} is unlisted"
                slots = {self.slot(p, off) for off in range(p.start, p.end)}
                assert not slots & claimed, f"slots {sorted(slots & claimed)} owned twice"
                claimed |= slots
            held = sum(p.length for p in pieces)
            assert self.held.get(owner, 0) == held, f"{owner!r}: held {self.held.get(owner)}"
        assert all(n > 0 for n in self.held.values()) and set(self.held) <= set(self.segs)
        num_pieces = sum(len(self.pieces(o)) for o in self.segs)
        assert num_pieces == sum(len(lt) + len(rt) for lt, rt in self.sides), "a stray piece"
        assert self.free_blocks <= set(self._free_heap), "a free block missing from the heap"
        for block, sides in enumerate(self.sides):
            assert (block in self.free_blocks) == (not sides[0] and not sides[1]), block
            for side in (0, 1):
                assert all((p.block, p.side) == (block, side) for p in sides[side]), "misfiled"
            assert self.end(block, 0) + self.end(block, 1) <= size, f"block {block} overlaps"
        assert self.num_empty == self.capacity_tokens - len(claimed), "empty-slot count is off"


def bump(counter: dict[Hashable, int], owner: Hashable, delta: int) -> None:
    """Add ``delta`` to ``owner``'s count; a count that reaches 0 leaves the dict."""
    if n := counter.get(owner, 0) + delta:
        counter[owner] = n
    else:
        counter.pop(owner, None)
