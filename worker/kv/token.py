"""Token-granular KV allocator: a slot per token, no fragmentation (the simulator default)."""

from __future__ import annotations

from collections.abc import Hashable

from sgl_fair.worker.kv.base import OutOfMemory


class TokenAllocator:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"KV capacity must be >= 1 token (got {capacity_tokens})")
        self._capacity = capacity_tokens
        self._free = capacity_tokens
        self._held: dict[Hashable, int] = {}

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

    def transfer(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        held = self._held.get(src, 0)
        if num_tokens < 0 or num_tokens > held:
            raise ValueError(f"{src!r} holds {held} tokens, cannot transfer {num_tokens}")
        if num_tokens == 0:
            return
        if num_tokens == held:
            del self._held[src]
        else:
            self._held[src] = held - num_tokens
        self._held[dst] = self._held.get(dst, 0) + num_tokens

    def held(self, owner: Hashable) -> int:
        return self._held.get(owner, 0)

    def owners(self) -> list[Hashable]:
        return list(self._held)

    def check_invariants(self) -> None:
        assert self._free >= 0, f"negative free count {self._free}"
        assert all(n > 0 for n in self._held.values()), "an owner holds <= 0 tokens"
        total = self._free + sum(self._held.values())
        assert total == self._capacity, f"free + held = {total} != capacity {self._capacity}"
