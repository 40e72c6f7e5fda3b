"""Token-granular KV allocator: a slot per token, no fragmentation (the simulator default).

By default it keeps counts only (the simulator's hot path). ``exact=True`` (or
``enable_exact()`` while empty, which ``PrefixKVCache(exact=True)`` calls) gives every token a
slot id in ``[0, capacity)``: each owner's slots in logical order, a free list, and
``flat_slots`` / ``free_slots`` for a real engine. Counts behave the same in both modes:
``free`` releases an owner's last tokens, ``transfer`` hands over its first ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import islice

from sgl_fair.worker.kv.base import OutOfMemory


@dataclass(frozen=True)
class TokenConfig:
    """The token allocator has no options (``make_allocator("token", n)``)."""


class TokenAllocator:
    Config = TokenConfig
    block_size = 1  # flat slot == slot id

    def __init__(self, capacity_tokens: int, *, exact: bool = False) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"KV capacity must be >= 1 token (got {capacity_tokens})")
        self._capacity = capacity_tokens
        self._free = capacity_tokens
        self._held: dict[Hashable, int] = {}
        # Exact mode: owner -> its slot ids in logical order (a dict as an ordered set), and
        # a stack of free ids (lowest on top). None: counts only.
        self._slots: dict[Hashable, dict[int, None]] | None = None
        self._free_ids: list[int] = []
        if exact:
            self.enable_exact()

    @property
    def exact(self) -> bool:
        return self._slots is not None

    def enable_exact(self) -> None:
        """Give every token a slot id from now on (only while nothing is held)."""
        if self._slots is not None:
            return
        if self._held:
            raise ValueError("enable_exact() on a token allocator that holds tokens")
        self._slots = {}
        self._free_ids = list(range(self._capacity - 1, -1, -1))

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    def num_free_tokens(self) -> int:
        return self._free

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool:
        return 0 <= num_tokens <= self._free

    def allocate(self, owner: Hashable, num_tokens: int) -> None:
        if not self.can_allocate(owner, num_tokens):
            raise OutOfMemory(f"need {num_tokens} tokens, {self._free} free")
        if num_tokens:
            self._free -= num_tokens
            self._held[owner] = self._held.get(owner, 0) + num_tokens
            if self._slots is not None:
                ids = self._free_ids
                taken = ids[-num_tokens:]
                del ids[-num_tokens:]
                self._slots.setdefault(owner, {}).update(dict.fromkeys(reversed(taken)))

    def free(self, owner: Hashable, num_tokens: int | None = None) -> None:
        held = self._held.get(owner, 0)
        n = held if num_tokens is None else num_tokens
        if n < 0 or n > held:
            raise ValueError(f"{owner!r} holds {held} tokens, cannot free {n}")
        if n == held:
            self._held.pop(owner, None)
        else:
            self._held[owner] = held - n
        self._free += n
        if self._slots is not None and n:
            mine = self._slots[owner]
            self._free_ids.extend(mine.popitem()[0] for _ in range(n))  # its last n
            if not mine:
                del self._slots[owner]

    def free_slots(self, owner: Hashable, flat_slots: Iterable[int]) -> None:
        """Free exactly these slots of ``owner`` (exact mode)."""
        if self._slots is None:
            raise ValueError("free_slots needs an exact token allocator")
        mine = self._slots.get(owner, {})
        flat_slots = list(flat_slots)
        if len(set(flat_slots)) != len(flat_slots) or any(s not in mine for s in flat_slots):
            raise ValueError(f"{owner!r} does not hold all of slots {flat_slots}")
        for s in flat_slots:
            del mine[s]
        self._free_ids.extend(flat_slots)
        n = len(flat_slots)
        self._free += n
        if n == self._held.get(owner, 0):
            self._held.pop(owner, None)
            self._slots.pop(owner, None)
        elif n:
            self._held[owner] -= n

    def flat_slots(self, owner: Hashable) -> list[int]:
        """``owner``'s slot ids in logical order (exact mode)."""
        if self._slots is None:
            raise ValueError("flat_slots needs an exact token allocator")
        return list(self._slots.get(owner, ()))

    def transfer(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        held = self._held.get(src, 0)
        if num_tokens < 0 or num_tokens > held:
            raise ValueError(f"{src!r} holds {held} tokens, cannot transfer {num_tokens}")
        if num_tokens == 0 or src == dst:
            return
        if num_tokens == held:
            del self._held[src]
        else:
            self._held[src] = held - num_tokens
        self._held[dst] = self._held.get(dst, 0) + num_tokens
        if self._slots is not None:
            mine = self._slots[src]
            moved = list(islice(mine, num_tokens))  # its first num_tokens, in order
            for s in moved:
                del mine[s]
            if not mine:
                del self._slots[src]
            self._slots.setdefault(dst, {}).update(dict.fromkeys(moved))

    def held(self, owner: Hashable) -> int:
        return self._held.get(owner, 0)

    def owners(self) -> list[Hashable]:
        return list(self._held)

    def check_invariants(self) -> None:
        assert self._free >= 0, f"negative free count {self._free}"
        assert all(n > 0 for n in self._held.values()), "an owner holds <= 0 tokens"
        total = self._free + sum(self._held.values())
        assert total == self._capacity, f"free + held = {total} != capacity {self._capacity}"
        if self._slots is None:
            return
        assert len(self._free_ids) == self._free, "free list and free count disagree"
        assert {o: len(s) for o, s in self._slots.items()} == self._held, "slot lists vs counts"
        every = [*self._free_ids, *(s for slots in self._slots.values() for s in slots)]
        assert sorted(every) == list(range(self._capacity)), "a slot is lost or owned twice"
