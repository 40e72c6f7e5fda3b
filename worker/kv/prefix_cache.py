"""The radix prefix cache on top of a KV allocator (SGLang's RadixCache, in token counts).

Every KV token is in exactly one of four states::

    capacity = free + cached (in the tree, unlocked: evictable LRU)
                    + locked (in the tree, a running request's prefix)
                    + private (a running request's own, not yet in the tree)

Rules the scheduler relies on:

* A request locks the tree node ending at its matched prefix *before* allocating,
  so allocation-driven eviction can never take its prefix away.
* ``allocate`` evicts LRU cached tokens as needed; eviction may free more than asked.
* ``commit`` moves a request's computed tokens into the tree (private → tree),
  freeing any it duplicated because another request inserted them meanwhile.
* ``check_invariants`` proves the equation above.

Two independent feeds tell a router what the cache holds, both off by default (a lone
simulated worker pays nothing): ``record_evictions``/``drain_evicted`` (evicted blocks,
for the simulator's ``Evicted`` messages) and ``record_kv_events``/``drain_kv_events``
(every store, eviction and flush, in order, for SGLang-format KV events; see
``sgl_fair.kv_events.KVEventEncoder``).

Exact mode (``exact=True``, for a real engine; off, the simulator's count-only path is
unchanged): each tree node's ``slots`` holds the flat device slot (``block * block_size +
slot``) of each of its tokens. ``commit`` frees exactly the owner's duplicated (leading)
tokens and records the slots it hands to the tree on the new leaf; eviction and ``flush``
free exactly the evicted nodes' slots; ``kv_slots(owner, handle)`` lists a running request's
slots in logical order. The allocator needs ``flat_slots``/``free_slots`` (all three have
them; the token allocator switches to slot ids); checkpointing allocators journal their copies
for ``drain_copies`` (``Batch.kv_copies``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from sgl_fair.radix import MatchMemo, Node, RadixTree
from sgl_fair.worker.kv.base import CACHE, KVAllocator, OutOfMemory

# A cache change for KV events: ("stored", path, start) — the cache now also holds
# path[start:]; ("removed", path, start) — it dropped path[start:]; ("cleared", (), 0).
KVChange = tuple[str, tuple[int, ...], int]


class PrefixHandle(NamedTuple):
    prefix_len: int
    node: Node


class KVUsage(NamedTuple):
    free: int
    cached: int
    locked: int
    private: int


class PrefixKVCache:
    def __init__(
        self, allocator: KVAllocator, tree: RadixTree | None = None, *, exact: bool = False
    ) -> None:
        self.allocator = allocator
        self.exact = exact
        if exact:
            if not hasattr(allocator, "free_slots") or (tree is not None and tree.total_tokens):
                raise ValueError("exact mode needs an allocator with free_slots and an empty tree")
            for name in ("enable_exact", "record_copies"):
                fn = getattr(allocator, name, None)
                if fn is not None:
                    fn()
        self._classed = hasattr(allocator, "set_class")  # places requests by RT/BE class
        self._extend_in_room = getattr(allocator, "extend_in_room", None)  # base.py: optional
        self.tree = tree if tree is not None else RadixTree()
        self.num_evicted_tokens = 0
        # Evicted blocks ``(path, start)`` not yet reported; None = nobody listens (a single
        # simulated worker). A worker behind a router drains it with ``drain_evicted()``.
        self._evicted: list[tuple[tuple[int, ...], int]] | None = None
        # Cache changes not yet drained; None = not recording (the default, zero cost).
        self._kv_events: list[KVChange] | None = None

    def record_evictions(self) -> None:
        """Start remembering evicted blocks for ``drain_evicted`` (router sync)."""
        if self._evicted is None:
            self._evicted = []

    def drain_evicted(self) -> list[tuple[tuple[int, ...], int]]:
        """Blocks evicted since the last call, oldest first: ``path[start:]`` is gone."""
        out, self._evicted = self._evicted or [], ([] if self._evicted is not None else None)
        return out

    def record_kv_events(self) -> None:
        """Start remembering every store, eviction and flush for ``drain_kv_events``."""
        if self._kv_events is None:
            self._kv_events = []

    def drain_kv_events(self) -> list[KVChange]:
        """Cache changes since the last call, oldest first (empty when not recording).

        ``("stored", path, start)``: ``commit`` added ``path[start:]`` below the cached
        ``path[:start]``; ``("removed", path, start)``: eviction dropped ``path[start:]``
        (a whole leaf, so nothing below it); ``("cleared", (), 0)``: ``flush`` emptied the
        cache. Replayed in order from when recording began, they track what the tree holds.
        """
        out = self._kv_events
        if out is None:
            return []
        self._kv_events = []
        return out

    def drain_copies(self) -> list:
        """KV copies (``engine.KVCopy``) the allocator made since the last call, in order
        (checkpoints and restores; empty unless exact over a checkpointing allocator)."""
        fn = getattr(self.allocator, "drain_copies", None)
        return fn() if fn is not None else []

    def kv_slots(self, owner: Hashable, handle: PrefixHandle) -> list[int]:
        """Exact mode: the flat slots of ``owner``'s positions ``0 .. n-1`` in logical order
        (n = ``handle.prefix_len`` + its resident private tokens): the tree path to
        ``handle.node``, then its own (including a slot already allocated for its next token)."""
        if not self.exact:
            raise ValueError("kv_slots needs PrefixKVCache(exact=True)")
        self._check_resident(owner)
        parts, node = [], handle.node
        while node is not self.tree.root:
            parts.append(node.slots)
            node = node.parent
        out = [s for part in reversed(parts) for s in part]
        assert len(out) == handle.prefix_len, "a cached prefix without slots"
        return out + self.allocator.flat_slots(owner)

    def _check_resident(self, owner: Hashable) -> None:
        ckpt = getattr(self.allocator, "checkpointed_slots", None)
        if ckpt is not None and ckpt(owner):
            raise ValueError(f"{owner!r} has KV on the host: restore it first")

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_tokens

    def available_tokens(self, owner: Hashable = None) -> int:
        """Free now, or freeable by evicting unlocked cached prefixes. With ``owner``, for its
        class where the allocator places by class (bidirectional: RT may also overwrite BE)."""
        kw = self._class_of(owner) if owner is not None else {}
        if kw and (fn := getattr(self.allocator, "num_free_tokens_for", None)) is not None:
            return fn(kw["request_class"]) + self.tree.evictable_tokens
        return self.allocator.num_free_tokens() + self.tree.evictable_tokens

    def pin(self, owner: Hashable) -> None:
        """Protect ``owner``'s KV from being overwritten by another class until ``unpin_all``
        (no-op unless the allocator overwrites)."""
        fn = getattr(self.allocator, "pin", None)
        if fn is not None:
            fn(owner)

    def unpin_all(self) -> None:
        fn = getattr(self.allocator, "unpin_all", None)
        if fn is not None:
            fn()

    def keeps_private(self, owner: Hashable) -> bool:
        """Whether ``owner``'s KV should enter the tree only when it finishes: another class
        may overwrite it (bidirectional: BE), and the tree pins what it holds."""
        kw = self._class_of(owner)
        fn = getattr(self.allocator, "overwritable", None)
        return bool(kw) and fn is not None and fn(kw["request_class"])

    def overwrites(self, owner: Hashable) -> frozenset[str]:
        """Request classes whose KV ``owner`` may overwrite (checkpointed to host): their
        future tokens are no reservation against ``owner``. Empty unless the allocator
        places by class."""
        kw = self._class_of(owner)
        fn = getattr(self.allocator, "overwrites", None)
        return fn(kw["request_class"]) if kw and fn is not None else frozenset()

    def match_len(self, tokens: Sequence[int]) -> int:
        """Cached prefix length; no LRU touch, no locking (for ordering policies)."""
        return self.tree.match_len(tokens)

    def memo_match(self, tokens: Sequence[int], memo: MatchMemo | None) -> MatchMemo:
        """Cached prefix length, remembered across steps while the request's path is unchanged."""
        return self.tree.memo_match(tokens, memo)

    def acquire_prefix(self, tokens: tuple[int, ...], *, limit: int) -> PrefixHandle:
        """Match and lock the longest cached prefix of ``tokens``, at most ``limit`` long."""
        matched = min(self.tree.match(tokens).length, limit)
        node = self.tree.root
        if matched > 0:
            # Inserting an existing prefix adds nothing; it splits the edge so a node ends
            # exactly at `matched`, which is what gets locked.
            node = self.tree.insert(tokens[:matched]).node
        self.tree.lock(node)
        return PrefixHandle(matched, node)

    @property
    def classed(self) -> bool:
        """Whether the allocator places requests by RT/BE class (bidirectional blocks)."""
        return self._classed

    def _class_of(self, owner: Hashable) -> dict:
        """``request_class=`` for allocators that place by RT/BE class (bidirectional)."""
        if not self._classed:
            return {}
        cls = getattr(owner, "service_class", None)
        return {} if cls is None else {"request_class": getattr(cls, "value", cls)}

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool:
        """Whether ``allocate`` will succeed: the allocator's own answer after a dry-run
        eviction of every evictable prefix (block allocators: tokens are not blocks)."""
        kw = self._class_of(owner)
        # A cheap gate first. An RT request may also overwrite BE KV: the allocator decides.
        if num_tokens < 0 or (num_tokens > self.available_tokens() and not self.overwrites(owner)):
            return False
        alloc = self.allocator
        if alloc.can_allocate(owner, num_tokens, **kw):
            return True
        evictable = self.tree.evictable_tokens
        probe = getattr(alloc, "can_allocate_after_free", None)
        if probe is None or not evictable:  # token pools: free + evictable is exact
            return probe is None
        if self.exact:  # exactly the slots eviction can free, not CACHE's last ones
            kw["slots"] = self._evictable_slots()
        return probe(owner, num_tokens, CACHE, evictable, **kw)

    def _evictable_slots(self) -> list[int]:
        """Slots of every unlocked node (an unlocked node's subtree is all unlocked)."""
        out, stack = [], list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref == 0:
                out.extend(node.slots)
            stack.extend(node.children.values())
        return out

    def allocate_each(self, owners: Sequence[Hashable]) -> int:
        """``allocate(owner, 1)`` for each owner in order (a decode step's growth); returns
        how many got their token: all, or those before the first that raised OutOfMemory
        (it and the rest unchanged). Tokens in an owner's own room go through the allocator's
        ``extend_in_room`` in one call while a free block remains (with none, ``allocate``
        evicts first, and so does this), the others through ``allocate``."""
        fast, n, i = self._extend_in_room, len(owners), 0
        while i < n:
            if fast is not None and self.allocator.num_free_tokens() > 0:
                i = fast(owners, i)
                if i == n:
                    break
            try:
                self.allocate(owners[i], 1)
            except OutOfMemory:
                return i
            i += 1
        return n

    def allocate(self, owner: Hashable, num_tokens: int) -> None:
        kw = self._class_of(owner)
        alloc = self.allocator
        short = num_tokens - alloc.num_free_tokens()
        if short <= 0:  # nothing to evict: the allocator checks before it changes anything
            try:
                alloc.allocate(owner, num_tokens, **kw)
                return
            except OutOfMemory:
                pass
        if not self.can_allocate(owner, num_tokens):  # check before evicting anything
            raise OutOfMemory(f"need {num_tokens} tokens, {self.available_tokens(owner)} available")
        if short > 0:
            self._evict(short)
        while not self.allocator.can_allocate(owner, num_tokens, **kw):
            if not self.tree.evictable_tokens:
                raise OutOfMemory(f"no block room for {num_tokens} tokens of {owner!r}")
            self._evict(1)  # evicts at least one whole leaf
        self.allocator.allocate(owner, num_tokens, **kw)

    def forget(self, owner: Hashable) -> None:
        """A request left: drop its class registration (allocators that keep one)."""
        fn = getattr(self.allocator, "forget", None)
        if fn is not None:
            fn(owner)

    def evict_all(self) -> int:
        """Evict every unlocked cached prefix (reported and counted as evictions, unlike
        ``flush``); returns the tokens freed. The scheduler's last resort when block
        fragmentation around cached prefixes keeps a waiting request out (issue 31)."""
        before = self.num_evicted_tokens
        if self.tree.evictable_tokens:
            self._evict(self.tree.evictable_tokens)
        return self.num_evicted_tokens - before

    def _evict(self, num_tokens: int) -> None:
        slots: list[int] | None = [] if self.exact else None
        blocks = self.tree.evict(num_tokens, slots=slots)
        freed = sum(len(path) - start for path, start in blocks)
        if self._evicted is not None:
            self._evicted.extend(blocks)
        if self._kv_events is not None:
            self._kv_events.extend([("removed", path, start) for path, start in blocks])
        if freed:
            self._free_cached(freed, slots)
            self.num_evicted_tokens += freed

    def _free_cached(self, num_tokens: int, slots: list[int] | None) -> None:
        if slots is None:
            self.allocator.free(CACHE, num_tokens)  # counts: CACHE's last tokens
        else:
            self.allocator.free_slots(CACHE, slots)

    def commit(
        self, owner: Hashable, tokens: tuple[int, ...], handle: PrefixHandle
    ) -> PrefixHandle:
        """Insert ``owner``'s computed ``tokens`` into the tree; returns the new locked handle.

        ``owner`` privately holds the KV of ``tokens[handle.prefix_len:]`` (and maybe more,
        e.g. a slot reserved for its next token, which stays private).
        """
        res = self.tree.insert(tokens)
        if res.prefix_len < handle.prefix_len:
            raise AssertionError("a locked prefix disappeared from the tree")
        duplicated = res.prefix_len - handle.prefix_len
        if self.exact:
            # Its private tokens are positions prefix_len.. in order: the first `duplicated`
            # (already in the tree) are freed, the next num_new become the new leaf's.
            self._check_resident(owner)
            mine = self.allocator.flat_slots(owner)
            if duplicated:
                self.allocator.free_slots(owner, mine[:duplicated])
            if res.num_new:
                res.node.slots = mine[duplicated : duplicated + res.num_new]
                self.allocator.transfer(owner, CACHE, res.num_new)
        else:
            self.allocator.transfer(owner, CACHE, res.num_new)
            if duplicated:
                self.allocator.free(owner, duplicated)
        if res.num_new and self._kv_events is not None:
            # The insert added tokens[prefix_len:] (prefix_len = len - num_new) as one leaf.
            self._kv_events.append(("stored", tuple(tokens), res.prefix_len))
        self.tree.lock(res.node)
        self.tree.unlock(handle.node)
        return PrefixHandle(len(tokens), res.node)

    def restore(self, owner: Hashable) -> list | None:
        """Copy ``owner``'s checkpointed KV back to the device (bidirectional blocks), evicting
        LRU cached prefixes until the allocator can place it; the copies, or None if even an
        empty cache leaves no room (the caller then pauses or retracts someone)."""
        alloc = self.allocator
        while alloc.restore_plan(owner) is None:
            if not self.tree.evictable_tokens:
                return None
            self._evict(1)  # evicts at least one whole leaf
        return alloc.restore(owner)

    def flush(self) -> bool:
        """Drop every cached prefix, as SGLang's ``/flush_cache``; False if it cannot.

        Like SGLang, only an idle cache can be flushed: if any request locks a prefix or
        holds KV privately, nothing happens and this returns False. The dropped blocks are
        reported to ``drain_evicted`` (the router must forget them), and as one
        ``("cleared", (), 0)`` to ``drain_kv_events``. They do not count as evictions
        (``num_evicted_tokens`` measures memory pressure).
        """
        tree = self.tree
        if tree.locked_tokens or self.usage().private:
            return False
        slots: list[int] | None = [] if self.exact else None
        if self._evicted is not None or slots is not None:
            blocks = tree.evict(tree.total_tokens, slots=slots)
            if self._evicted is not None:
                self._evicted.extend(blocks)
            freed = sum(len(path) - start for path, start in blocks)
        else:
            freed = tree.discard_lru(tree.total_tokens)
        if freed:
            self._free_cached(freed, slots)
        if self._kv_events is not None:
            self._kv_events.append(("cleared", (), 0))
        return True

    def freed_by_release(
        self, owner: Hashable, handle: PrefixHandle, for_owner: Hashable = None
    ) -> int:
        """About what ``release(owner, handle)`` adds to ``available_tokens(for_owner)``: what
        ``owner`` holds privately (where the allocator places by class, the room it gives
        ``for_owner``'s class: ``room_freed_by``), plus the prefix edges only it locks (they
        become evictable). Blocks shared with cached tokens may keep a few of them in use."""
        kw = self._class_of(for_owner) if for_owner is not None else {}
        room_freed_by = getattr(self.allocator, "room_freed_by", None)
        if kw and room_freed_by is not None:
            freed = room_freed_by(owner, kw["request_class"])
        else:
            freed = self.allocator.held(owner)
        node, root = handle.node, self.tree.root
        while node is not root and node.lock_ref == 1:  # ancestors: lock_ref >= a child's
            freed += len(node.key)
            node = node.parent
        return freed

    def release(self, owner: Hashable, handle: PrefixHandle) -> None:
        """Free everything ``owner`` holds privately and unlock its prefix."""
        self.allocator.free(owner)
        self.tree.unlock(handle.node)

    def usage(self) -> KVUsage:
        tree = self.tree
        free = self.allocator.num_free_tokens()
        private = self.capacity_tokens - free - tree.total_tokens
        return KVUsage(free, tree.evictable_tokens, tree.locked_tokens, private)

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        self.tree.check_invariants()
        held = self.allocator.held(CACHE)
        assert held == self.tree.total_tokens, (
            f"allocator says the cache holds {held} tokens, the tree {self.tree.total_tokens}"
        )
        u = self.usage()
        assert min(u) >= 0, f"negative KV state {u}"
        assert sum(u) == self.capacity_tokens, f"{u} does not add up to {self.capacity_tokens}"
        if self.exact:  # the tree's slots are exactly CACHE's
            nodes, stack = [], list(self.tree.root.children.values())
            while stack:
                nodes.append(stack.pop())
                stack.extend(nodes[-1].children.values())
            assert all(n.slots is not None and len(n.slots) == len(n.key) for n in nodes)
            tree_slots = sorted(s for n in nodes for s in n.slots)
            assert tree_slots == sorted(self.allocator.flat_slots(CACHE)), "tree slots != CACHE's"
