"""PagedAllocator: block-granular KV, against a slot-by-slot naive model, and under PrefixKVCache.

The naive model keeps an owner per slot and each owner's slots in logical order; everything
the allocator reports (held, free blocks, room, block tables, fragmentation, can_allocate) must
equal what the model derives from its slots, after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.worker.kv import CACHE, KVAllocator, OutOfMemory, PagedAllocator, PrefixKVCache

# ---------------------------------------------------------------- hand-built cases


def test_paged_allocator_is_a_kv_allocator() -> None:
    alloc = PagedAllocator(70, block_size=16)
    assert isinstance(alloc, KVAllocator)
    assert alloc.capacity_tokens == 64  # whole blocks only
    with pytest.raises(ValueError, match="block"):
        PagedAllocator(15, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        PagedAllocator(64, block_size=0)


def test_allocation_fills_the_last_block_before_taking_a_new_one() -> None:
    alloc = PagedAllocator(32, block_size=4)  # 8 blocks
    alloc.allocate("a", 5)
    assert alloc.block_table("a") == [0, 1] and alloc.room("a") == 3
    assert alloc.num_free_tokens() == 24 and alloc.num_fragmented_tokens() == 3
    alloc.allocate("b", 1)
    alloc.allocate("a", 3)  # exactly the room: no new block
    assert alloc.block_table("a") == [0, 1] and alloc.room("a") == 0
    alloc.allocate("a", 1)
    assert alloc.block_table("a") == [0, 1, 3]  # block 2 is b's
    alloc.check_invariants()


def test_can_allocate_counts_the_owners_room_and_whole_free_blocks() -> None:
    alloc = PagedAllocator(16, block_size=4)
    alloc.allocate("a", 6)  # blocks 0, 1 (2 slots of room)
    alloc.allocate("b", 5)  # blocks 2, 3 (3 slots of room)
    assert alloc.num_free_tokens() == 0
    assert alloc.can_allocate("a", 2) and not alloc.can_allocate("a", 3)
    assert alloc.can_allocate("b", 3) and not alloc.can_allocate("c", 1)
    with pytest.raises(OutOfMemory):
        alloc.allocate("a", 3)
    assert alloc.held("a") == 6 and alloc.block_table("a") == [0, 1]  # refused: nothing changed
    alloc.check_invariants()


def test_free_releases_from_the_end_and_returns_emptied_blocks() -> None:
    alloc = PagedAllocator(16, block_size=4)
    alloc.allocate("a", 10)
    alloc.free("a", 3)  # the third block (2 tokens) and one slot of the second
    assert alloc.block_table("a") == [0, 1] and alloc.held("a") == 7
    assert alloc.num_free_tokens() == 8 and alloc.room("a") == 1
    with pytest.raises(ValueError):
        alloc.free("a", 8)
    alloc.free("a")
    assert alloc.owners() == [] and alloc.num_free_tokens() == 16
    alloc.check_invariants()


def test_transfer_relabels_in_place_and_shares_the_boundary_block() -> None:
    alloc = PagedAllocator(16, block_size=4)
    alloc.allocate("r", 7)  # blocks 0 [r r r r], 1 [r r r .]
    alloc.transfer("r", CACHE, 5)  # block 1 becomes [C r r .]
    assert alloc.num_free_tokens() == 8  # nothing allocated, nothing copied
    assert alloc.block_table(CACHE) == [0, 1] and alloc.block_table("r") == [1]
    assert (alloc.held(CACHE), alloc.held("r")) == (5, 2)
    assert alloc.room(CACHE) == 0 and alloc.room("r") == 1  # only the top extent may grow
    alloc.free("r")  # block 1: [C . . .] stays used: 3 slots are fragmentation now
    assert alloc.num_fragmented_tokens() == 3 and alloc.num_free_tokens() == 8
    alloc.check_invariants()


def test_transfers_merge_only_contiguous_pieces() -> None:
    alloc = PagedAllocator(8, block_size=8)
    alloc.allocate("r", 6)
    alloc.transfer("r", CACHE, 2)
    alloc.free(CACHE, 1)  # a hole at slot 1: [C . r r r r . .]
    alloc.transfer("r", CACHE, 2)
    alloc.transfer("r", CACHE, 1)  # contiguous with the previous hand-over: merged
    assert alloc.layout.slot_mapping(CACHE) == [(0, 0), (0, 2), (0, 3), (0, 4)]
    assert alloc.block_table(CACHE) == [0] and alloc.room("r") == 2
    assert len(alloc.layout.sides[0][0]) == 3  # C at 0, C at 2..4, r at 5
    alloc.check_invariants()


# ---------------------------------------------------------------- the naive model


class NaivePaged:
    """An owner per slot; each owner's slots in logical order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.size = block_size
        self.slots: list[list[object]] = [[None] * block_size for _ in range(num_blocks)]
        self.seq: dict[object, list[tuple[int, int]]] = {}

    def free_blocks(self) -> list[int]:
        return [b for b, slots in enumerate(self.slots) if all(o is None for o in slots)]

    def room(self, owner: object) -> int:
        if not self.seq.get(owner):
            return 0
        block, slot = self.seq[owner][-1]
        above = self.slots[block][slot + 1 :]
        return len(above) if all(o is None for o in above) else 0

    def can_allocate(self, owner: object, n: int) -> bool:
        return 0 <= n <= self.room(owner) + len(self.free_blocks()) * self.size

    def allocate(self, owner: object, n: int) -> None:
        seq = self.seq.setdefault(owner, [])
        while n:
            if self.room(owner):
                block, slot = seq[-1]
                where = (block, slot + 1)
            else:
                where = (self.free_blocks()[0], 0)
            self.slots[where[0]][where[1]] = owner
            seq.append(where)
            n -= 1

    def free(self, owner: object, n: int) -> None:
        for _ in range(n):
            block, slot = self.seq[owner].pop()
            self.slots[block][slot] = None

    def transfer(self, src: object, dst: object, n: int) -> None:
        if src == dst or not n:
            return
        moved, self.seq[src] = self.seq[src][:n], self.seq[src][n:]
        for block, slot in moved:
            self.slots[block][slot] = dst
        self.seq.setdefault(dst, []).extend(moved)

    def held(self, owner: object) -> int:
        return len(self.seq.get(owner, ()))

    def block_table(self, owner: object) -> list[int]:
        table: list[int] = []
        for block, _ in self.seq.get(owner, ()):
            if not table or table[-1] != block:
                table.append(block)
        return table


OWNERS = ("a", "b", "c", CACHE)
paged_ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.sampled_from(OWNERS), st.integers(-1, 20)),
        st.tuples(st.just("free"), st.sampled_from(OWNERS), st.none() | st.integers(-1, 20)),
        st.tuples(
            st.just("transfer"),
            st.sampled_from(OWNERS),
            st.sampled_from(OWNERS),
            st.integers(-1, 20),
        ),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(1, 8),
    block_size=st.sampled_from([1, 2, 4, 5]),
    ops=paged_ops,
)
def test_paged_allocator_matches_a_slot_by_slot_model(
    num_blocks: int, block_size: int, ops: list[tuple]
) -> None:
    alloc = PagedAllocator(num_blocks * block_size, block_size=block_size)
    model = NaivePaged(num_blocks, block_size)
    for op in ops:
        if op[0] == "allocate":
            _, owner, n = op
            assert alloc.can_allocate(owner, n) == model.can_allocate(owner, n)
            if model.can_allocate(owner, n):
                alloc.allocate(owner, n)
                model.allocate(owner, n)
            else:
                with pytest.raises(OutOfMemory):
                    alloc.allocate(owner, n)
        elif op[0] == "free":
            _, owner, n = op
            amount = model.held(owner) if n is None else n
            if 0 <= amount <= model.held(owner):
                alloc.free(owner, n)
                model.free(owner, amount)
            else:
                with pytest.raises(ValueError):
                    alloc.free(owner, n)
        else:
            _, src, dst, n = op
            if 0 <= n <= model.held(src):
                alloc.transfer(src, dst, n)
                model.transfer(src, dst, n)
            else:
                with pytest.raises(ValueError):
                    alloc.transfer(src, dst, n)
        alloc.check_invariants()
        assert alloc.num_free_tokens() == len(model.free_blocks()) * block_size
        for owner in OWNERS:
            assert alloc.held(owner) == model.held(owner)
            assert alloc.room(owner) == model.room(owner)
            assert alloc.block_table(owner) == model.block_table(owner)
            assert alloc.layout.slot_mapping(owner) == model.seq.get(owner, [])
        used = sum(o is not None for slots in model.slots for o in slots)
        assert alloc.num_fragmented_tokens() == (
            (num_blocks - len(model.free_blocks())) * block_size - used
        )


# ---------------------------------------------------------------- under the radix cache


def seq(start: int, length: int) -> tuple[int, ...]:
    return tuple(range(start, start + length))


def check(kv: PrefixKVCache) -> tuple[int, int, int, int]:
    kv.check_invariants()
    return tuple(kv.usage())


def test_prefix_cache_commit_release_and_reuse_over_paged_blocks() -> None:
    kv = PrefixKVCache(PagedAllocator(64, block_size=4))  # 16 blocks
    prompt = seq(1, 10)
    handle = kv.acquire_prefix(prompt, limit=9)
    kv.allocate("x", 11)  # 3 blocks: the prompt and a slot for the first output token
    assert check(kv) == (52, 0, 0, 12)  # private includes the last block's empty slot
    handle = kv.commit("x", prompt, handle)
    assert kv.allocator.held(CACHE) == 10 and kv.allocator.held("x") == 1
    assert check(kv) == (52, 0, 10, 2)  # x's block [C C x .]: 1 token + 1 wasted slot
    kv.release("x", handle)
    assert check(kv) == (52, 10, 0, 2)  # the shared block's slots stay wasted
    # A second request reuses the prefix and computes only its suffix.
    tokens = prompt + seq(500, 6)
    handle = kv.acquire_prefix(tokens, limit=len(tokens) - 1)
    assert handle.prefix_len == 10
    kv.allocate("y", 7)
    handle = kv.commit("y", tokens, handle)
    assert kv.allocator.held(CACHE) == 16 and kv.allocator.held("y") == 1
    kv.release("y", handle)
    check(kv)


def test_prefix_cache_evicts_whole_blocks_and_frees_duplicates() -> None:
    kv = PrefixKVCache(PagedAllocator(32, block_size=4))  # 8 blocks
    old, new = seq(1, 8), seq(100, 8)  # block-aligned prefixes
    for owner, tokens in (("x", old), ("y", new)):
        handle = kv.acquire_prefix(tokens, limit=8)
        kv.allocate(owner, 8)
        kv.release(owner, kv.commit(owner, tokens, handle))
    assert check(kv) == (16, 16, 0, 0)
    kv.allocate("r", 24)  # 8 short: evicts the LRU prefix, two whole blocks
    assert kv.match_len(old) == 0 and kv.match_len(new) == 8
    assert check(kv) == (0, 8, 0, 24)
    kv.allocator.free("r")
    # Two requests compute the same prompt at once: the second commit frees its duplicate.
    hx, hy = kv.acquire_prefix(old, limit=7), kv.acquire_prefix(old, limit=7)
    kv.allocate("x", 9)
    kv.allocate("y", 9)
    hx = kv.commit("x", old, hx)
    hy = kv.commit("y", old, hy)
    assert kv.allocator.held("y") == 1 and kv.tree.total_tokens == 16
    check(kv)
    kv.release("x", hx)
    kv.release("y", hy)
    assert check(kv) == (16, 16, 0, 0)


def test_prefix_cache_promise_holds_over_paged_blocks() -> None:
    kv = PrefixKVCache(PagedAllocator(12, block_size=4))  # 3 blocks
    for owner, tokens in (("a", seq(1, 1)), ("b", seq(100, 4))):
        handle = kv.acquire_prefix(tokens, limit=len(tokens))
        kv.allocate(owner, len(tokens))
        kv.release(owner, kv.commit(owner, tokens, handle))
    assert kv.can_allocate("r", 5)  # 4 free + 5 evictable
    kv.allocate("r", 5)


cache_ops = st.lists(
    st.tuples(
        st.sampled_from(("admit", "commit", "release", "grow")),
        st.integers(0, 3),  # owner
        st.integers(0, 2),  # prefix
        st.integers(0, 9),  # suffix length (admit) / tokens to grow
    ),
    max_size=50,
)
PREFIXES = (seq(1, 12), seq(1, 6) + seq(50, 6), seq(100, 9))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(num_blocks=st.integers(3, 20), block_size=st.sampled_from([1, 4, 5]), ops=cache_ops)
def test_random_prefix_cache_lifecycles_over_paged_blocks(
    num_blocks: int, block_size: int, ops: list[tuple[int, ...]]
) -> None:
    """Admit / commit / grow / release as a scheduler would; the cache's promise may fail only
    where the allocator itself says no (fragmentation), and never corrupts anything."""
    kv = PrefixKVCache(PagedAllocator(num_blocks * block_size, block_size=block_size))
    active: dict[int, tuple] = {}
    suffix_ids = iter(range(10_000, 1_000_000))
    for op, owner, prefix, n in ops:
        if op == "admit" and owner not in active:
            tokens = PREFIXES[prefix] + tuple(next(suffix_ids) for _ in range(n))
            handle = kv.acquire_prefix(tokens, limit=len(tokens))
            need = len(tokens) - handle.prefix_len
            if try_allocate(kv, owner, need):
                active[owner] = (handle, tokens)
            else:
                kv.tree.unlock(handle.node)
        elif op == "commit" and owner in active:
            handle, tokens = active[owner]
            active[owner] = (kv.commit(owner, tokens, handle), tokens)
        elif op == "grow" and owner in active:
            try_allocate(kv, owner, n)
        elif op == "release" and owner in active:
            kv.release(owner, active.pop(owner)[0])
            assert kv.allocator.held(owner) == 0
        check(kv)
        for handle, tokens in active.values():
            assert kv.match_len(tokens) >= handle.prefix_len, "a locked prefix was evicted"
    for owner, (handle, _) in list(active.items()):
        kv.release(owner, handle)
    usage = check(kv)
    assert usage[2] == 0 and kv.allocator.held(CACHE) == kv.tree.total_tokens


def try_allocate(kv: PrefixKVCache, owner: int, n: int) -> bool:
    if not kv.can_allocate(owner, n):
        with pytest.raises(OutOfMemory):
            kv.allocate(owner, n)
        return False
    held = kv.allocator.held(owner)
    try:
        kv.allocate(owner, n)
    except OutOfMemory:
        # The token-counting cache over-promised: after its evictions the allocator must
        # truly lack room for this owner, and the owner must hold what it held before.
        assert not kv.allocator.can_allocate(owner, n)
        assert kv.allocator.held(owner) == held
        return False
    assert kv.allocator.held(owner) == held + n
    return True


def test_the_kept_emptiest_order_matches_a_rescan_after_few_or_many_changes() -> None:
    """``BlockLayout.emptiest`` re-places touched blocks one by one, or re-sorts every block
    when many were touched (a long stretch without asking): ``check`` compares both with a
    rescan, and the large case takes no quadratic time."""
    alloc = PagedAllocator(4096 * 4, block_size=4)
    for i in range(1500):
        alloc.allocate(f"r{i}", 1 + i % 7)  # thousands of blocks touched: the re-sort
    alloc.layout.check()
    for i in range(0, 1500, 250):
        alloc.free(f"r{i}")  # a few: one by one
        alloc.layout.check()
    assert alloc.layout.emptiest(0)[0][0] == 0  # free blocks (no run on the other side) first


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(2, 12),
    block_size=st.sampled_from([1, 3, 4]),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    cached=st.integers(0, 6),
    steps=st.integers(1, 12),
)
def test_allocate_each_is_allocate_one_owner_after_another(
    num_blocks: int, block_size: int, sizes: list[int], cached: int, steps: int
) -> None:
    """A decode step's growth in one call (the paged allocator's in-room fast path) leaves
    exactly the state that ``allocate(owner, 1)`` per owner leaves, stopping at the same
    owner when the pool runs out (evicting cached tokens the same way on the way)."""

    def build() -> tuple[PrefixKVCache, list[str]]:
        kv = PrefixKVCache(PagedAllocator(num_blocks * block_size, block_size=block_size))
        if cached:  # evictable tokens: growth past the free blocks evicts them
            tokens = seq(1, cached)
            handle = kv.acquire_prefix(tokens, limit=cached)
            if kv.can_allocate("c", cached):
                kv.allocate("c", cached)
                kv.release("c", kv.commit("c", tokens, handle))
            else:
                kv.tree.unlock(handle.node)
        owners = []
        for i, n in enumerate(sizes):
            if kv.can_allocate(f"r{i}", n):
                kv.allocate(f"r{i}", n)
                owners.append(f"r{i}")
        return kv, owners

    batched, owners = build()
    single, _ = build()
    for _ in range(steps):
        got = batched.allocate_each(owners)
        want = 0
        for owner in owners:
            try:
                single.allocate(owner, 1)
            except OutOfMemory:
                break
            want += 1
        assert got == want
        for owner in owners:
            assert batched.allocator.block_table(owner) == single.allocator.block_table(owner)
            assert batched.allocator.held(owner) == single.allocator.held(owner)
        assert check(batched) == check(single)
        if got < len(owners):
            break


def test_grow_fresh_refuses_more_than_the_free_blocks_and_loses_none():
    """``BlockLayout.grow_fresh`` takes blocks off the free heap for good; asked for more
    than is free (a caller's bug) it says so and every free block stays allocatable."""
    alloc = PagedAllocator(16, block_size=4)  # 4 blocks
    alloc.allocate("a", 5)  # blocks 0, 1
    with pytest.raises(ValueError, match="free blocks"):
        alloc.layout.grow_fresh("b", 0, 9)  # needs 3, 2 are free
    alloc.check_invariants()
    alloc.allocate("b", 8)  # both free blocks are still found
    assert alloc.block_table("b") == [2, 3] and alloc.num_free_tokens() == 0
