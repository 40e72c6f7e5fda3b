"""The KV allocator seam: check-then-commit, so a step never half-allocates.

The scheduler only ever talks to a ``PrefixKVCache``, which talks to a ``KVAllocator``; the
token-granular one is the default, and paged / bidirectional block allocators (the BROS
issue) replace it without touching the scheduler. Owners are opaque hashable keys: a request
object for its private KV, ``CACHE`` for tokens held by the radix tree.

Invariant (``check_invariants``): ``free + Σ held(owner) == capacity``.

Beyond ``KVAllocator`` an allocator may declare capabilities, each a Protocol below; the
prefix cache checks them once, when it is built (``AllocatorCaps.of``), and never probes
attributes afterwards:

* ``SlotAllocator`` — exact flat device slots (``PrefixKVCache(exact=True)``, a real engine);
* ``BlockAllocator`` — whole blocks: token counts cannot say whether a request fits;
* ``RoomExtending`` — a decode step's growth in one call (a speed-up only);
* ``ClassedAllocator`` — places requests by RT/BE class, one class may overwrite another;
* ``CheckpointingAllocator`` — moves KV to host memory and back (bidirectional blocks).

All three built-in allocators are ``SlotAllocator``; ``paged`` and ``bidirectional`` are
``BlockAllocator``; ``paged`` is ``RoomExtending``; ``bidirectional`` is ``ClassedAllocator``
and ``CheckpointingAllocator``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class _CacheOwner:
    def __repr__(self) -> str:
        return "CACHE"


CACHE: Hashable = _CacheOwner()


class OutOfMemory(RuntimeError):
    """``allocate`` called without a successful ``can_allocate`` (a scheduler bug)."""


@runtime_checkable
class KVAllocator(Protocol):
    @property
    def capacity_tokens(self) -> int:
        """Slots in the pool (whole blocks only for block allocators)."""
        ...

    def num_free_tokens(self) -> int:
        """Slots that no owner holds."""
        ...

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool:
        """Whether ``allocate(owner, num_tokens)`` would succeed now; changes nothing."""
        ...

    def allocate(self, owner: Hashable, num_tokens: int) -> None:
        """Give ``owner`` ``num_tokens`` more slots, or raise ``OutOfMemory`` having changed
        nothing."""
        ...

    def free(self, owner: Hashable, num_tokens: int | None = None) -> None:
        """Free ``num_tokens`` of ``owner``'s tokens (all of them when None)."""
        ...

    def transfer(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        """Hand tokens from one owner to another (a request's KV entering the radix cache)."""
        ...

    def held(self, owner: Hashable) -> int:
        """Device slots ``owner`` holds (0 for an unknown owner)."""
        ...

    def check_invariants(self) -> None:
        """Assert ``free + Σ held == capacity`` and the allocator's own structure."""
        ...


@runtime_checkable
class SlotAllocator(KVAllocator, Protocol):
    """Exact device slots, for ``PrefixKVCache(exact=True)`` and a real engine."""

    def enable_exact(self) -> None:
        """Enter exact mode (called once, while nothing is held): ``flat_slots`` are the
        slots an engine reads from now on; a checkpointing allocator journals its copies
        for ``drain_copies``."""
        ...

    def flat_slots(self, owner: Hashable) -> list[int]:
        """``owner``'s resident slots (``block * block_size + slot``), in logical order."""
        ...

    def free_slots(self, owner: Hashable, flat_slots: Iterable[int]) -> None:
        """Free exactly these slots of ``owner`` (not its last ones: the radix tree may keep
        the others)."""
        ...


@runtime_checkable
class BlockAllocator(KVAllocator, Protocol):
    """Whole blocks of ``block_size`` slots: room is per block, not a token count."""

    block_size: int

    def can_allocate_after_free(
        self, owner: Hashable, num_tokens: int, freed: Hashable, k: int, **kw: Any
    ) -> bool:
        """``can_allocate(owner, num_tokens)`` as if ``free(freed, k)`` had run (``slots=``:
        ``free_slots(freed, slots)``); a dry run that changes nothing and never over-promises.
        ``PrefixKVCache`` asks it with ``freed=CACHE`` before evicting cached prefixes."""
        ...


@runtime_checkable
class RoomExtending(Protocol):
    """A decode step's growth in one call (optional, for speed only)."""

    def extend_in_room(self, owners: Sequence[Hashable], start: int = 0) -> int:
        """Give each owner from ``start`` on one more token without taking a free block, in
        order; return the index of the first owner that needs more (it and the rest
        unchanged). ``PrefixKVCache.allocate_each`` calls it while a free block remains."""
        ...


@runtime_checkable
class ClassedAllocator(KVAllocator, Protocol):
    """Places requests by class (``"rt"``/``"be"``): the prefix cache passes
    ``request_class=`` to ``can_allocate``, ``allocate`` and ``can_allocate_after_free``,
    and one class may overwrite another's KV (checkpointed to host)."""

    def set_class(self, owner: Hashable, request_class: str) -> None:
        """Register ``owner``'s class (also set by ``allocate(..., request_class=)``)."""
        ...

    def forget(self, owner: Hashable) -> None:
        """Drop ``owner``'s class registration (it left; it must hold nothing)."""
        ...

    def num_free_tokens_for(self, request_class: str) -> int:
        """Room for a new request of the class (a token gate; ``can_allocate`` is exact)."""
        ...

    def room_freed_by(self, owner: Hashable, request_class: str) -> int:
        """How much ``num_free_tokens_for(request_class)`` grows if ``owner`` is dropped."""
        ...

    def overwrites(self, request_class: str) -> frozenset[str]:
        """The classes whose KV ``request_class`` may overwrite: their reserved output is no
        reservation against it."""
        ...

    def overwritable(self, request_class: str) -> bool:
        """Whether another class may overwrite this class's KV (such KV enters the radix
        tree only when its request finishes)."""
        ...

    def pin(self, owner: Hashable) -> None:
        """Protect ``owner``'s KV from being overwritten until ``unpin_all`` (a step pins
        what it prefills)."""
        ...

    def unpin_all(self) -> None:
        """Lift every ``pin`` (at the start of each step)."""
        ...


@runtime_checkable
class CheckpointingAllocator(KVAllocator, Protocol):
    """Moves KV to host memory (lazy checkpoints) and back (``restore``)."""

    host_capacity_tokens: int

    def checkpointed_slots(self, owner: Hashable) -> int:
        """Tokens of ``owner`` on the host now (0: all resident). Such an owner cannot grow
        or be read until restored."""
        ...

    def restore_plan(self, owner: Hashable) -> list | None:
        """The copies ``restore(owner)`` would make, or None if the device has no room for
        them now; changes nothing."""
        ...

    def restore(self, owner: Hashable) -> list:
        """Copy ``owner``'s checkpointed KV back to the device; the copies (each with
        ``num_tokens``), for an engine to do and a simulator to charge. Call only after a
        ``restore_plan`` that was not None."""
        ...

    def drain_copies(self) -> list:
        """Checkpoint and restore copies (``engine.KVCopy``) journalled since the last call,
        in the order an engine must do them (empty unless in exact mode)."""
        ...


@dataclass(frozen=True)
class AllocatorCaps:
    """An allocator's declared capabilities, checked once (``AllocatorCaps.of``): each field
    is the allocator itself where it has that capability, else None."""

    slots: SlotAllocator | None
    blocks: BlockAllocator | None
    room_extending: RoomExtending | None
    classed: ClassedAllocator | None
    checkpointing: CheckpointingAllocator | None

    @classmethod
    def of(cls, allocator: KVAllocator) -> AllocatorCaps:
        return cls(
            slots=allocator if isinstance(allocator, SlotAllocator) else None,
            blocks=allocator if isinstance(allocator, BlockAllocator) else None,
            room_extending=allocator if isinstance(allocator, RoomExtending) else None,
            classed=allocator if isinstance(allocator, ClassedAllocator) else None,
            checkpointing=allocator if isinstance(allocator, CheckpointingAllocator) else None,
        )

    @property
    def block_size(self) -> int:
        """Slots per block (1: token-granular)."""
        return self.blocks.block_size if self.blocks is not None else 1

    @property
    def host_capacity_tokens(self) -> int:
        """Host slots for checkpointed KV (0 unless the allocator checkpoints)."""
        ckpt = self.checkpointing
        return ckpt.host_capacity_tokens if ckpt is not None else 0
