"""The KV allocator seam: check-then-commit, so a step never half-allocates.

The scheduler only ever talks to a ``KVAllocator``; the token-granular one is
the default, and paged / bidirectional block allocators (the BROS issue)
replace it without touching the scheduler. Owners are opaque hashable keys: a
request object for its private KV, ``CACHE`` for tokens held by the radix tree.

Invariant (``check_invariants``): ``free + Σ held(owner) == capacity``.

Optional, beside the protocol: ``extend_in_room(owners, start) -> int`` gives each owner
from ``start`` on one more token without taking a free block (its own room), in order, and
returns the index of the first that needs more, unchanged. ``PrefixKVCache.allocate_each``
(a decode step's growth) uses it as a fast path; an allocator without it is asked owner by
owner (``PagedAllocator`` has it; the bidirectional one does not: its RT growth may
checkpoint BE slots, which needs the whole ``allocate``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable


class _CacheOwner:
    def __repr__(self) -> str:
        return "CACHE"


CACHE: Hashable = _CacheOwner()


class OutOfMemory(RuntimeError):
    """``allocate`` called without a successful ``can_allocate`` (a scheduler bug)."""


@runtime_checkable
class KVAllocator(Protocol):
    @property
    def capacity_tokens(self) -> int: ...

    def num_free_tokens(self) -> int: ...

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool: ...

    def allocate(self, owner: Hashable, num_tokens: int) -> None: ...

    def free(self, owner: Hashable, num_tokens: int | None = None) -> None:
        """Free ``num_tokens`` of ``owner``'s tokens (all of them when None)."""
        ...

    def transfer(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        """Hand tokens from one owner to another (a request's KV entering the radix cache)."""
        ...

    def held(self, owner: Hashable) -> int: ...

    def check_invariants(self) -> None: ...
