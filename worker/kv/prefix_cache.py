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
slots in logical order. The allocator must be a ``SlotAllocator`` (all three built-in ones
are; the token allocator switches to slot ids); checkpointing allocators journal their copies
for ``drain_copies`` (``Batch.kv_copies``).

The allocator's capabilities (``kv.base``: block, classed, checkpointing, ...) are checked
once, here, into ``caps``; the scheduler asks the cache, never the allocator.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from sgl_fair.radix import MatchMemo, Node, RadixTree
from sgl_fair.worker.kv.base import CACHE, AllocatorCaps, KVAllocator, OutOfMemory

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
        self.caps = caps = AllocatorCaps.of(allocator)  # checked once: never probed again
        self._slots = caps.slots
        self._classed = caps.classed  # places requests by RT/BE class
        self._ckpt = caps.checkpointing  # moves KV to host and back
        room_extending = caps.room_extending
        self._extend_in_room = room_extending.extend_in_room if room_extending else None
        self._blocks = caps.blocks
        if exact:
            if self._slots is None or (tree is not None and tree.total_tokens):
                raise ValueError("exact mode needs a SlotAllocator and an empty tree")
            self._slots.enable_exact()
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
        return self._ckpt.drain_copies() if self._ckpt is not None else []

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
        return out + self._exact_slots().flat_slots(owner)

    def _exact_slots(self):  # noqa: ANN202 - the SlotAllocator exact mode checked for
        assert self._slots is not None
        return self._slots

    def _check_resident(self, owner: Hashable) -> None:
        if self.checkpointed_slots(owner):
            raise ValueError(f"{owner!r} has KV on the host: restore it first")

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_tokens

    def available_tokens(self, owner: Hashable = None) -> int:
        """Free now, or freeable by evicting unlocked cached prefixes. With ``owner``, for its
        class where the allocator places by class (bidirectional: RT may also overwrite BE)."""
        kw = self._class_of(owner) if owner is not None else {}
        if kw:
            free = self._classed.num_free_tokens_for(kw["request_class"])  # type: ignore[union-attr]
            return free + self.tree.evictable_tokens
        return self.allocator.num_free_tokens() + self.tree.evictable_tokens

    def pin(self, owner: Hashable) -> None:
        """Protect ``owner``'s KV from being overwritten by another class until ``unpin_all``
        (no-op unless the allocator overwrites)."""
        if self._classed is not None:
            self._classed.pin(owner)

    def unpin_all(self) -> None:
        """Lift every ``pin`` (each step starts unpinned)."""
        if self._classed is not None:
            self._classed.unpin_all()

    def keeps_private(self, owner: Hashable) -> bool:
        """Whether ``owner``'s KV should enter the tree only when it finishes: another class
        may overwrite it (bidirectional: BE), and the tree pins what it holds."""
        kw = self._class_of(owner)
        return bool(kw) and self._classed.overwritable(kw["request_class"])  # type: ignore[union-attr]

    def overwrites(self, owner: Hashable) -> frozenset[str]:
        """Request classes whose KV ``owner`` may overwrite (checkpointed to host): their
        future tokens are no reservation against ``owner``. Empty unless the allocator
        places by class."""
        kw = self._class_of(owner)
        return self._classed.overwrites(kw["request_class"]) if kw else frozenset()  # type: ignore[union-attr]

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
        return self._classed is not None

    @property
    def checkpoints(self) -> bool:
        """Whether the allocator moves KV to host memory and back (bidirectional blocks)."""
        return self._ckpt is not None

    @property
    def per_request_growth(self) -> bool:
        """Whether a token count cannot say if a request can grow (block allocators, or KV
        that may be on the host): growth is then tried request by request."""
        return self._ckpt is not None or self.caps.block_size > 1

    def checkpointed_slots(self, owner: Hashable) -> int:
        """Tokens of ``owner`` on the host (0 unless the allocator checkpoints)."""
        return self._ckpt.checkpointed_slots(owner) if self._ckpt is not None else 0

    def _class_of(self, owner: Hashable) -> dict:
        """``request_class=`` for allocators that place by RT/BE class (bidirectional)."""
        if self._classed is None:
            return {}
        cls = getattr(owner, "service_class", None)  # a request's; CACHE and keys have none
        return {} if cls is None else {"request_class": getattr(cls, "value", cls)}

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool:
        """Whether ``allocate`` will succeed: the allocator's own answer after a dry-run
        eviction of every evictable prefix (block allocators: tokens are not blocks)."""
        kw = self._class_of(owner)
        if num_tokens < 0:
            return False
        alloc = self.allocator
        # The allocator first: tokens may fit in the owner's own last block while no whole
        # block is free, which the token gate below cannot see (found by bros-bicache).
        if alloc.can_allocate(owner, num_tokens, **kw):
            return True
        # A cheap gate next. An RT request may also overwrite BE KV: the allocator decides.
        if num_tokens > self.available_tokens() and not self.overwrites(owner):
            return False
        evictable = self.tree.evictable_tokens
        blocks = self._blocks
        if blocks is None or not evictable:  # token pools: free + evictable is exact
            return blocks is None
        if self.exact:  # exactly the slots eviction can free, not CACHE's last ones
            kw["slots"] = self._evictable_slots()
        return blocks.can_allocate_after_free(owner, num_tokens, CACHE, evictable, **kw)

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
        # Nothing to evict (free tokens, or room in the owner's own block; an owner that may
        # overwrite another class's KV evicts cached prefixes first): the allocator checks
        # before it changes anything.
        if short <= 0 or (
            not self.overwrites(owner) and alloc.can_allocate(owner, num_tokens, **kw)
        ):
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
        if self._classed is not None:
            self._classed.forget(owner)

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
            self._exact_slots().free_slots(CACHE, slots)

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
            slots = self._exact_slots()
            mine = slots.flat_slots(owner)
            if duplicated:
                slots.free_slots(owner, mine[:duplicated])
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
        alloc = self._ckpt
        if alloc is None:
            raise ValueError("restore: the allocator never moves KV to host")
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
        if kw:
            freed = self._classed.room_freed_by(owner, kw["request_class"])  # type: ignore[union-attr]
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
            assert tree_slots == sorted(self._exact_slots().flat_slots(CACHE)), "tree != CACHE's"
