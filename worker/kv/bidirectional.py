"""Bidirectional KV blocks (BROS, SPEC §5): RT fills a block from the left, BE from the right.

A block of S slots holds at most one RT and one BE request; they meet in the middle::

    slot    0 1 2 3 4 5 6 7        (S = 8)
          [ r r r . . b b b ]      block_table: r -> (blk, 0, 3), b -> (blk, 1, 3)
          [ r r r r r r b b ]      r grew 3: two empty slots, then b's innermost (newest) slot,
                                   copied to host first: b -> [Checkpoint(blk, slot=5, 1, ...)]

* BE (prefill or growth) takes the room after its run in its last block, then blocks with an
  empty right side, most empty slots first (so free blocks first, lowest id first).
* RT takes the empty room in its last block, then free blocks; with none free, the BE slots of
  its last block; then it preempts the block without a left run with the most empty slots.
* Lazy checkpointing: only BE slots an RT is about to overwrite go to host memory, into a host
  block that mirrors the device block's slots. A checkpointed BE request cannot grow until
  ``restore`` copies it back into fresh blocks; the copies (``CopyOp``) are returned for an
  engine to do and a simulator to charge. With the host full, ``can_allocate`` says False and
  ``victims_for`` names requests whose ``drop`` makes room (BE first).
* Classes come from ``set_class`` or ``allocate(..., request_class=)``, unknown owners are BE; a
  class stays until ``forget``/``drop`` (``PrefixKVCache`` passes the request's
  ``service_class`` and forgets finished requests).
* CACHE: ``transfer(req, CACHE, n)`` re-labels the first n resident tokens in place (no copy,
  never fails); a side may hold a CACHE piece, then the request it came from. CACHE is pinned:
  never overwritten, never a victim (the radix tree evicts). Other transfers are refused: they
  would put two requests on one side of a block.

Exact mode (``PrefixKVCache(exact=True)``): ``flat_slots``/``free_slots`` as in ``paged`` (the
same hole rule: placement starts at a side's innermost end; RT reach and overwrite walk the BE
pieces by offset, so they see holes between pieces as empty), and ``record_copies`` journals
every checkpoint (device -> host) and restore as ``engine.KVCopy``, in order, for
``drain_copies``. RT reach stops at a pinned CACHE piece, so a hole outside one waits for it
to be evicted (room lost, never a wrong slot).

``held`` counts resident tokens (checkpointed ones use the host); every empty slot is free
(``free + Σ held == capacity``), but only the runs around it reach it: ``can_allocate`` (an
exact dry run of the placement) is the test to use.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from sgl_fair.worker.engine import KVCopy
from sgl_fair.worker.kv.base import CACHE, OutOfMemory
from sgl_fair.worker.kv.layout import BlockLayout, Piece, bump
from sgl_fair.worker.kv.paged import DEFAULT_BLOCK_SIZE, PagedConfig
from sgl_fair.worker.kv.placement import BE, LEFT, RIGHT, RT, SIDE
from sgl_fair.worker.kv.placement import plan as placement_plan
from sgl_fair.worker.kv.registry import register_allocator
from sgl_fair.worker.kv.rt_room import RTRoom


@dataclass(frozen=True)
class BidirectionalConfig(PagedConfig):
    host_capacity_tokens: int | None = None  # None: as much host memory as device memory

    def __post_init__(self) -> None:
        super().__post_init__()
        h = self.host_capacity_tokens
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 0):
            raise ValueError(f"host_capacity_tokens must be an integer >= 0 (got {h!r})")


class BlockEntry(NamedTuple):  # direction 0: read slots left→right (RT), 1: right→left (BE)
    block: int
    direction: int
    fill: int


class Checkpoint(NamedTuple):  # device slots [slot, slot + num_tokens) now at host_offset
    block: int
    slot: int
    num_tokens: int
    host_offset: int


class CopyOp(NamedTuple):  # host [host_offset, +num_tokens) -> device block [slot, +num_tokens)
    host_offset: int
    block: int
    slot: int
    num_tokens: int


@dataclass(eq=False)
class _Host:
    """Checkpointed tokens: device ``block`` slots [lo, lo + length), mirrored in ``host_block``."""

    owner: Hashable
    block: int
    host_block: int
    lo: int
    length: int
    piece: Piece | None  # the device piece it continues (None once that piece is gone)


@register_allocator("bidirectional")
class BidirectionalAllocator:
    Config = BidirectionalConfig

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        host_capacity_tokens: int | None = None,
    ) -> None:
        self.config = BidirectionalConfig(block_size, host_capacity_tokens)
        self.layout = BlockLayout(capacity_tokens, block_size)
        self.block_size, self.num_blocks = block_size, self.layout.num_blocks
        host = capacity_tokens if host_capacity_tokens is None else host_capacity_tokens
        self.host_capacity_tokens, self.num_host_blocks = host, host // block_size
        self._free_host = list(range(self.num_host_blocks))  # a heap: lowest id first
        self._ckpt: dict[Hashable, int] = {}
        self._class: dict[Hashable, str] = {}
        self.pinned: set[Hashable] = set()  # BE owners RT must not overwrite now (``pin``)
        self._rt_room = RTRoom(self.layout, self._pinned)  # num_free_tokens_for(RT)
        self._copies: list[KVCopy] | None = None  # the copy journal; None: not recording

    def enable_exact(self) -> None:
        """Exact mode (``SlotAllocator``): slots are always exact; journal the copies."""
        self.record_copies()

    def record_copies(self) -> None:
        """Journal every checkpoint and restore copy from now on (``drain_copies``)."""
        if self._copies is None:
            self._copies = []

    def drain_copies(self) -> list[KVCopy]:
        """Copies since the last call, in the order an engine must do them."""
        out = self._copies or []
        if self._copies is not None:
            self._copies = []
        return out

    def flat_slots(self, owner: Hashable) -> list[int]:
        """Resident slots (``block * S + slot``), logical order; checkpointed ones are not."""
        return self.layout.flat_slots(owner)

    def free_slots(self, owner: Hashable, flat_slots: Iterable[int]) -> None:
        """Free exactly these resident slots of ``owner`` (holes: module docstring)."""
        self.layout.release_slots(owner, flat_slots)

    @property
    def capacity_tokens(self) -> int:
        return self.layout.capacity_tokens

    def num_free_tokens(self) -> int:
        return self.layout.num_empty

    def num_free_tokens_for(self, request_class: str) -> int:
        """Room for a new request of the class (a token gate; ``can_allocate`` is exact).

        BE: every empty slot (``num_free_tokens``). RT: what a new RT run can reach — free
        blocks, and blocks without a left run up to their pinned CACHE slots, their BE slots
        counted while a host block is left to checkpoint them (or they already have one).
        Room left inside another RT request's block is that request's, as in ``paged``.
        Kept per block (``rt_room.RTRoom``)."""
        if self._checked_class(None, request_class) == BE:
            return self.layout.num_empty
        return self._rt_room.value(self.num_free_host_blocks())

    def room_freed_by(self, owner: Hashable, request_class: str) -> int:
        """How much ``num_free_tokens_for(request_class)`` grows if ``owner`` is dropped
        (device and host). BE: the slots it holds. RT, for a BE owner: what its blocks add
        beyond the BE slots RT already counts, which is something only where host blocks
        run short (its own come back, and its blocks may empty); an RT owner's blocks are
        its own room, so 0."""
        if self._checked_class(None, request_class) == BE:
            return self.held(owner)
        if self.class_of(owner) != BE:
            return 0
        host_left = self.num_free_host_blocks()
        mine = sum(isinstance(s, _Host) for s in self.layout.segs.get(owner, ()))
        rt_room = self._rt_room
        return rt_room.value_without(owner, host_left + mine) - rt_room.value(host_left)

    def pin(self, owner: Hashable) -> None:
        """Keep RT from overwriting ``owner``'s slots until ``unpin_all`` (a scheduler pins
        the requests it prefills in a step: overwriting them would undo the step's work)."""
        self.pinned.add(owner)
        self._touch(owner)

    def unpin_all(self) -> None:
        for owner in self.pinned:
            self._touch(owner)
        self.pinned.clear()

    def _touch(self, owner: Hashable) -> None:
        """The RT room of ``owner``'s blocks changed (``BlockLayout.touched``)."""
        self.layout.touched.update(p.block for p in self.layout.pieces(owner))

    def _pinned(self, owner: Hashable) -> bool:
        return owner is CACHE or owner in self.pinned

    def overwrites(self, request_class: str) -> frozenset[str]:
        """The classes whose KV ``request_class`` may overwrite (RT: BE's, checkpointed)."""
        return frozenset({BE}) if self._checked_class(None, request_class) == RT else frozenset()

    def overwritable(self, request_class: str) -> bool:
        """Whether another class may overwrite this class's KV (BE: RT does). Such KV should
        stay the request's own until it finishes: a CACHE piece is pinned."""
        return self._checked_class(None, request_class) == BE

    def held(self, owner: Hashable) -> int:
        return self.layout.held.get(owner, 0)

    def checkpointed_slots(self, owner: Hashable) -> int:
        return self._ckpt.get(owner, 0)

    def logical_len(self, owner: Hashable) -> int:
        return self.held(owner) + self.checkpointed_slots(owner)

    def host_used_tokens(self) -> int:
        return sum(self._ckpt.values())

    def num_free_host_blocks(self) -> int:
        """Host blocks left for lazy checkpoints (each holds one block's overwritten slots)."""
        return len(self._free_host)

    def owners(self) -> list[Hashable]:
        return list(self.layout.segs)

    def class_of(self, owner: Hashable) -> str:
        return self._class.get(owner, BE)

    def block_table(self, owner: Hashable) -> list[BlockEntry]:
        """Resident pieces in logical order. (A piece that follows a CACHE head starts after
        it; ``slot_mapping`` is exact — only a prefix-cache user meets this.)"""
        return [BlockEntry(p.block, p.side, p.length) for p in self.layout.pieces(owner)]

    def slot_mapping(self, owner: Hashable) -> list[tuple[int, int]]:
        """(block, slot) of each resident token of ``owner``, in logical order."""
        return self.layout.slot_mapping(owner)

    def checkpoints(self, owner: Hashable) -> list[Checkpoint]:
        size = self.block_size
        return [
            Checkpoint(h.block, h.lo, h.length, h.host_block * size + h.lo)
            for h in self.layout.segs.get(owner, ())
            if isinstance(h, _Host)
        ]

    def preemption_table(self) -> dict[Hashable, list[Checkpoint]]:
        return {owner: self.checkpoints(owner) for owner in self._ckpt}

    def set_class(self, owner: Hashable, request_class: str) -> None:
        self._class[owner] = self._checked_class(owner, request_class)

    def forget(self, owner: Hashable) -> None:
        """Drop ``owner``'s class registration (a finished request)."""
        if self.logical_len(owner):
            raise ValueError(f"{owner!r} still holds tokens; free or drop it first")
        self._class.pop(owner, None)

    # ------------------------------------------------------------ check-then-commit

    def can_allocate(
        self, owner: Hashable, num_tokens: int, *, request_class: str | None = None
    ) -> bool:
        cls = self._checked_class(owner, request_class)
        cur = self.layout.growable(owner, SIDE[cls])
        room = 0 if cur is None else self.layout.room(cur)
        if 0 <= num_tokens <= room + len(self.layout.free_blocks) * self.block_size:
            return not (num_tokens and cls == BE and self.checkpointed_slots(owner))
        return placement_plan(self, owner, cls, num_tokens) is not None

    def can_allocate_after_free(
        self,
        owner: Hashable,
        num_tokens: int,
        freed: Hashable,
        k: int,
        *,
        request_class: str | None = None,
        slots: list[int] | None = None,
    ) -> bool:
        """``can_allocate`` once ``free(freed, k)`` (``slots``: ``free_slots(freed, slots)``)
        has run, never over-promising: the blocks it would empty count as free; preemption on
        top of that is not counted."""
        if self.can_allocate(owner, num_tokens, request_class=request_class):
            return True
        cls = self._checked_class(owner, request_class)
        if num_tokens and cls == BE and self.checkpointed_slots(owner):
            return False
        cur = self.layout.growable(owner, SIDE[cls])
        room = 0 if cur is None else self.layout.room(cur)
        num_free = len(self.layout.free_blocks) + self.layout.blocks_freed_by(freed, k, slots)
        return 0 <= num_tokens <= room + num_free * self.block_size

    def allocate(
        self, owner: Hashable, num_tokens: int, *, request_class: str | None = None
    ) -> None:
        cls = self._checked_class(owner, request_class)
        plan = placement_plan(self, owner, cls, num_tokens)
        if plan is None:
            raise OutOfMemory(f"no room for {num_tokens} {cls} tokens of {owner!r}")
        if request_class is not None:
            self._class[owner] = cls
        for block, k in plan:
            piece = self.layout.grow(owner, SIDE[cls], block, k)
            if cls == RT:
                self._overwrite(block, piece.end)

    def free(self, owner: Hashable, num_tokens: int | None = None) -> None:
        """Free ``owner``'s last tokens, resident or checkpointed (all of them when None)."""
        total = self.logical_len(owner)
        n = total if num_tokens is None else num_tokens
        if n < 0 or n > total:
            raise ValueError(f"{owner!r} holds {total} tokens (with host), cannot free {n}")
        while n:
            segs = self.layout.segs[owner]
            seg = segs[-1]
            k = min(n, seg.length)
            n -= k
            if isinstance(seg, Piece):
                self.layout.shrink(seg, k)
                continue
            seg.length -= k
            seg.lo += k  # its newest tokens sit at its lowest slots
            bump(self._ckpt, owner, -k)
            if not seg.length:
                self._release_host(segs.pop())
                if not segs:
                    del self.layout.segs[owner]

    def transfer(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        """Hand ``src``'s first ``num_tokens`` resident tokens to CACHE, in place."""
        head, moving = 0, []
        for seg in self.layout.segs.get(src, ()):
            if isinstance(seg, _Host) or head >= num_tokens:
                break
            head += seg.length
            moving.append(seg)
        if num_tokens < 0 or num_tokens > head:
            raise ValueError(f"{src!r} leads with {head} resident tokens, cannot hand {num_tokens}")
        if num_tokens == 0 or src == dst:
            return
        if dst is not CACHE:
            raise ValueError("bidirectional blocks hand tokens to CACHE only (one request a side)")
        if head == num_tokens and moving[-1].ckpt is not None:  # moves whole: the copy stays
            moving[-1].ckpt.piece = None
            moving[-1].ckpt = None
        self.layout.hand_over(src, dst, num_tokens)

    # ------------------------------------------------------------ restore, drop

    def restore_plan(self, owner: Hashable) -> list[CopyOp] | None:
        """The host→device copies ``restore`` would do now; None if the device lacks room."""
        targets = self._restore_targets(owner)
        return None if targets is None else [op for _, _, ops in targets for op in ops]

    def restore(self, owner: Hashable) -> list[CopyOp]:
        """Bring all of ``owner``'s checkpointed slots back; returns the copies to perform."""
        targets = self._restore_targets(owner)
        if targets is None:
            raise OutOfMemory(f"no room to restore {self.checkpointed_slots(owner)} tokens")
        for host, grants, _ in targets:
            segs = self.layout.segs[owner]
            i = next(i for i, s in enumerate(segs) if s is host)
            segs[i : i + 1] = [self.layout.new_piece(owner, b, RIGHT, k) for b, k in grants]
            self._release_host(host)
            bump(self._ckpt, owner, -host.length)
        ops = [op for _, _, ops in targets for op in ops]
        if self._copies is not None:
            self._copies.extend(KVCopy(False, *op) for op in ops)
        return ops

    def drop(self, owner: Hashable) -> int:
        """Last resort: free all of ``owner`` (device and host); returns the tokens lost."""
        if owner is CACHE:
            raise ValueError("CACHE is evicted by the radix tree, never dropped")
        lost = self.logical_len(owner)
        self.free(owner)
        self._class.pop(owner, None)
        return lost

    def victims_for(
        self, num_tokens: int, *, owner: Hashable = None, urgency: Callable | None = None
    ) -> list[Hashable] | None:
        """Whom to ``drop`` so that ``owner`` (default: a new RT request) gets ``num_tokens``:
        BE requests first, then RT; each lowest ``urgency(o)`` first, else largest first.
        ``[]`` if nothing needs dropping; None if dropping everyone would not do."""
        cls = RT if owner is None else self.class_of(owner)
        key = urgency or (lambda o: -self.held(o))
        others = [o for o in self.layout.segs if o is not CACHE and o != owner]
        order = sorted((o for o in others if self.class_of(o) == BE), key=key)
        order += sorted((o for o in others if self.class_of(o) == RT), key=key)
        for i in range(len(order) + 1):
            if placement_plan(self, owner, cls, num_tokens, frozenset(order[:i])) is not None:
                return order[:i]
        return None

    def _restore_targets(self, owner: Hashable) -> list[tuple[_Host, list, list[CopyOp]]] | None:
        """Each checkpoint, where it goes back (as BE prefill would place it), and the copies.

        Oldest tokens sit at the highest slots; each target is a fresh right side, where they
        land in slots [S - k, S) in the same orientation: one contiguous copy per target."""
        size, taken, targets = self.block_size, set(), []
        for host in (s for s in self.layout.segs.get(owner, ()) if isinstance(s, _Host)):
            grants = self.layout.fresh(RIGHT, host.length, taken=taken)
            if grants is None:
                return None
            taken.update(b for b, _ in grants)
            end, ops = host.lo + host.length, []
            for block, k in grants:
                ops.append(CopyOp(host.host_block * size + end - k, block, size - k, k))
                end -= k
            targets.append((host, grants, ops))
        return targets

    # ------------------------------------------------------------ overwriting

    def _checked_class(self, owner: Hashable, request_class: str | None) -> str:
        if request_class is None:
            return self.class_of(owner)
        if request_class not in SIDE:
            raise ValueError(f"request class must be 'rt' or 'be' (got {request_class!r})")
        if self.logical_len(owner) and self.class_of(owner) != request_class:
            raise ValueError(f"{owner!r} holds {self.class_of(owner)} tokens; free it first")
        return request_class

    def _overwrite(self, block: int, hi: int) -> None:
        """Checkpoint the BE slots below slot ``hi`` that an RT run has just taken."""
        size = self.block_size
        for piece in list(self.layout.sides[block][RIGHT]):
            if (k := min(hi, size - piece.start) - (size - piece.end)) > 0:
                assert piece.owner is not CACHE, "an RT run overwrote the cache"
                self._checkpoint(piece, k)

    def _checkpoint(self, piece: Piece, k: int) -> None:
        host = piece.ckpt
        if host is None:
            lo = self.block_size - piece.end  # the innermost slot
            host = _Host(piece.owner, piece.block, heapq.heappop(self._free_host), lo, 0, piece)
            segs = self.layout.segs[piece.owner]
            segs.insert(next(i for i, s in enumerate(segs) if s is piece) + 1, host)
            piece.ckpt = host
            self.layout.touched.add(piece.block)
        if self._copies is not None:  # its k innermost slots, mirrored in the host block
            slot = self.block_size - piece.end
            self._copies.append(
                KVCopy(True, host.host_block * self.block_size + slot, piece.block, slot, k)
            )
        host.length += k
        bump(self._ckpt, piece.owner, k)
        self.layout.shrink(piece, k)  # +k empty slots: the RT's grow counted them all as taken
        if not piece.length:
            host.piece = None

    def _release_host(self, host: _Host) -> None:
        heapq.heappush(self._free_host, host.host_block)
        if host.piece is not None:
            host.piece.ckpt = None
            self.layout.touched.add(host.piece.block)

    def check_invariants(self) -> None:
        size, layout, host_blocks = self.block_size, self.layout, set()
        layout.check()
        host_left = self.num_free_host_blocks()
        assert self._rt_room.value(host_left) == self._rt_room.scan(host_left), "stale RT room"
        for owner, segs in layout.segs.items():
            ckpt = 0
            for i, host in enumerate(segs):
                if not isinstance(host, _Host):
                    assert host.ckpt is None or host.ckpt.piece is host, "one-way checkpoint"
                    continue
                assert owner is not CACHE and self.class_of(owner) == BE, "non-BE checkpoint"
                assert host.lo >= 0 and host.lo + host.length <= size, f"bad range {host}"
                assert host.host_block not in host_blocks, f"host block {host.host_block} twice"
                host_blocks.add(host.host_block)
                if (p := host.piece) is not None:  # it continues p: right after it, both ways
                    assert p.ckpt is host and i and segs[i - 1] is p, "checkpoint adrift"
                    assert host.lo + host.length == size - p.end, "checkpoint not contiguous"
                ckpt += host.length
            assert self.checkpointed_slots(owner) == ckpt, f"{owner!r}: checkpoint count"
        assert all(n > 0 for n in self._ckpt.values()) and set(self._ckpt) <= set(layout.segs)
        assert self.host_used_tokens() <= self.host_capacity_tokens, "host overcommitted"
        every, num_host = set(range(self.num_host_blocks)), len(host_blocks) + len(self._free_host)
        assert host_blocks | set(self._free_host) == every == set(range(num_host)), "host blocks"
        for block, sides in enumerate(layout.sides):
            for side, want in ((LEFT, RT), (RIGHT, BE)):
                requests = {p.owner for p in sides[side] if p.owner is not CACHE}
                assert len(requests) <= 1, f"block {block} side {side} holds {requests}"
                assert all(self.class_of(o) == want for o in requests), f"{requests} misplaced"
        total = layout.num_empty + sum(layout.held.values())
        assert total == self.capacity_tokens, f"free + held = {total} != {self.capacity_tokens}"
