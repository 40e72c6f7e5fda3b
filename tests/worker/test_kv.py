"""KV allocators and the radix prefix cache: check-then-commit, LRU eviction, locks, commits.

Every state a test builds is checked with ``check_invariants`` and the four-way equation
``free + cached + locked + private == capacity``; the property tests replay random operation
sequences against a naive model (plain dicts of token counts).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.worker.kv import (
    CACHE,
    KVAllocator,
    OutOfMemory,
    PrefixHandle,
    PrefixKVCache,
    TokenAllocator,
)


def make_kv(capacity: int) -> PrefixKVCache:
    return PrefixKVCache(TokenAllocator(capacity))


def check(kv: PrefixKVCache) -> tuple[int, int, int, int]:
    kv.check_invariants()
    usage = kv.usage()
    assert min(usage) >= 0 and sum(usage) == kv.capacity_tokens, usage
    return tuple(usage)


def seq(start: int, length: int) -> tuple[int, ...]:
    return tuple(range(start, start + length))


def compute(kv: PrefixKVCache, owner: object, tokens: tuple[int, ...]) -> PrefixHandle:
    """What the scheduler does for a prompt: lock its cached prefix, allocate the rest, commit."""
    handle = kv.acquire_prefix(tokens, limit=len(tokens))
    kv.allocate(owner, len(tokens) - handle.prefix_len)
    return kv.commit(owner, tokens, handle)


def cache(kv: PrefixKVCache, owner: object, tokens: tuple[int, ...]) -> None:
    """Compute ``tokens`` and finish: they stay in the tree, unlocked (evictable)."""
    kv.release(owner, compute(kv, owner, tokens))


# ---------------------------------------------------------------- TokenAllocator


def test_token_allocator_is_a_kv_allocator() -> None:
    assert isinstance(TokenAllocator(8), KVAllocator)
    with pytest.raises(ValueError, match="capacity"):
        TokenAllocator(0)


def test_token_allocator_check_then_commit() -> None:
    alloc = TokenAllocator(10)
    alloc.allocate("a", 7)
    assert alloc.can_allocate("b", 3) and not alloc.can_allocate("b", 4)
    assert not alloc.can_allocate("b", -1)
    with pytest.raises(OutOfMemory):
        alloc.allocate("b", 4)
    with pytest.raises(OutOfMemory):
        alloc.allocate("b", -1)
    # A refused allocation changes nothing.
    assert (alloc.num_free_tokens(), alloc.held("a"), alloc.held("b")) == (3, 7, 0)
    alloc.allocate("b", 3)
    assert alloc.num_free_tokens() == 0 and alloc.held("b") == 3
    alloc.check_invariants()


def test_token_allocator_free_and_transfer_validate_counts() -> None:
    alloc = TokenAllocator(10)
    alloc.allocate("a", 6)
    with pytest.raises(ValueError):
        alloc.free("a", 7)
    with pytest.raises(ValueError):
        alloc.transfer("a", CACHE, 7)
    with pytest.raises(ValueError):
        alloc.free("nobody", 1)
    alloc.transfer("a", CACHE, 4)
    assert (alloc.held("a"), alloc.held(CACHE), alloc.num_free_tokens()) == (2, 4, 4)
    alloc.free("a")  # everything it holds
    assert alloc.held("a") == 0 and "a" not in alloc.owners()
    alloc.free(CACHE, 4)
    assert alloc.num_free_tokens() == 10 and alloc.owners() == []
    alloc.check_invariants()


OWNERS = ("a", "b", "c")
allocator_ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.sampled_from(OWNERS), st.integers(-2, 40)),
        st.tuples(st.just("free"), st.sampled_from(OWNERS), st.none() | st.integers(-2, 40)),
        st.tuples(
            st.just("transfer"),
            st.sampled_from(OWNERS),
            st.sampled_from(OWNERS),
            st.integers(-2, 40),
        ),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(capacity=st.integers(1, 64), ops=allocator_ops)
def test_token_allocator_matches_a_naive_model(capacity: int, ops: list[tuple]) -> None:
    alloc = TokenAllocator(capacity)
    held = dict.fromkeys(OWNERS, 0)
    for op in ops:
        free = capacity - sum(held.values())
        if op[0] == "allocate":
            _, owner, n = op
            if 0 <= n <= free:
                alloc.allocate(owner, n)
                held[owner] += n
            else:
                with pytest.raises(OutOfMemory):
                    alloc.allocate(owner, n)
        elif op[0] == "free":
            _, owner, n = op
            amount = held[owner] if n is None else n
            if 0 <= amount <= held[owner]:
                alloc.free(owner, n)
                held[owner] -= amount
            else:
                with pytest.raises(ValueError):
                    alloc.free(owner, n)
        else:
            _, src, dst, n = op
            if 0 <= n <= held[src]:
                alloc.transfer(src, dst, n)
                held[src] -= n
                held[dst] += n
            else:
                with pytest.raises(ValueError):
                    alloc.transfer(src, dst, n)
        alloc.check_invariants()
        assert alloc.num_free_tokens() == capacity - sum(held.values())
        assert all(alloc.held(o) == held[o] for o in OWNERS)
        assert set(alloc.owners()) == {o for o in OWNERS if held[o]}


# ---------------------------------------------------------------- PrefixKVCache


def test_allocate_beyond_available_raises() -> None:
    kv = make_kv(100)
    cache(kv, "done", seq(1, 30))
    kv.allocate("r", 50)
    assert kv.available_tokens() == 50  # 20 free + 30 evictable
    assert kv.can_allocate("s", 50) and not kv.can_allocate("s", 51)
    with pytest.raises(OutOfMemory):
        kv.allocate("s", 51)
    kv.allocate("s", 50)
    assert check(kv) == (0, 0, 0, 100)


def test_refused_allocation_leaves_the_cache_intact() -> None:
    kv = make_kv(100)
    cache(kv, "done", seq(1, 30))
    kv.allocate("r", 50)
    with pytest.raises(OutOfMemory):
        kv.allocate("s", 51)
    assert kv.match_len(seq(1, 30)) == 30


def test_allocation_evicts_the_least_recently_used_prefix() -> None:
    kv = make_kv(100)
    old, new = seq(1, 30), seq(100, 30)
    cache(kv, "x", old)
    cache(kv, "y", new)
    assert check(kv) == (40, 60, 0, 0)
    kv.allocate("r", 50)  # 10 short: evicts a whole LRU leaf (may free more than asked)
    assert kv.match_len(old) == 0 and kv.match_len(new) == 30
    assert kv.num_evicted_tokens == 30
    assert check(kv) == (20, 30, 0, 50)


def test_a_match_refreshes_a_prefix_against_eviction() -> None:
    kv = make_kv(100)
    old, new = seq(1, 30), seq(100, 30)
    cache(kv, "x", old)
    cache(kv, "y", new)
    kv.release("z", kv.acquire_prefix(old, limit=30))  # a request reused `old`, then left
    kv.allocate("r", 50)
    assert kv.match_len(old) == 30 and kv.match_len(new) == 0


def test_match_len_does_not_refresh() -> None:
    """Ordering policies peek with match_len; that must not change what gets evicted."""
    kv = make_kv(100)
    old, new = seq(1, 30), seq(100, 30)
    cache(kv, "x", old)
    cache(kv, "y", new)
    assert kv.match_len(old) == 30
    kv.allocate("r", 50)
    assert kv.match_len(old) == 0 and kv.match_len(new) == 30


def test_locked_prefix_is_never_evicted_by_allocation() -> None:
    kv = make_kv(100)
    pinned, loose = seq(1, 30), seq(100, 30)
    cache(kv, "x", pinned)
    cache(kv, "y", loose)  # more recent: LRU alone would evict `pinned` first
    handle = kv.acquire_prefix(pinned + seq(500, 5), limit=34)
    assert handle.prefix_len == 30
    assert check(kv) == (40, 30, 30, 0)
    assert kv.available_tokens() == 70
    kv.allocate("r", 70)  # everything that is not locked
    assert kv.match_len(pinned) == 30 and kv.match_len(loose) == 0
    assert not kv.can_allocate("s", 1)
    with pytest.raises(OutOfMemory):
        kv.allocate("s", 1)
    assert kv.match_len(pinned) == 30
    assert check(kv) == (0, 0, 30, 70)
    kv.release("r", handle)
    assert check(kv) == (70, 30, 0, 0)  # unlocked: evictable again


def test_lock_taken_mid_edge_pins_exactly_the_matched_tokens() -> None:
    kv = make_kv(100)
    cache(kv, "x", seq(1, 40))
    handle = kv.acquire_prefix(seq(1, 25) + (999,), limit=25)  # diverges inside the edge
    assert handle.prefix_len == 25
    assert check(kv) == (60, 15, 25, 0)
    kv.allocate("r", 75)  # evicts the unlocked tail of the edge only
    assert kv.match_len(seq(1, 40)) == 25
    kv.release("r", handle)
    assert check(kv) == (75, 25, 0, 0)


def test_commit_moves_private_tokens_into_the_tree() -> None:
    kv = make_kv(100)
    prompt = seq(1, 20)
    handle = kv.acquire_prefix(prompt, limit=19)
    kv.allocate("r", 21)  # prompt + a slot for the first output token
    assert check(kv) == (79, 0, 0, 21)
    handle = kv.commit("r", prompt, handle)
    assert handle.prefix_len == 20
    assert check(kv) == (79, 0, 20, 1)  # the slot stays private
    assert kv.allocator.held("r") == 1 and kv.allocator.held(CACHE) == 20
    kv.release("r", handle)
    assert check(kv) == (80, 20, 0, 0)
    assert kv.match_len(prompt) == 20


def test_commit_extends_a_cached_prefix_and_moves_the_lock() -> None:
    kv = make_kv(100)
    system = seq(1, 30)
    cache(kv, "x", system)
    tokens = system + seq(500, 10)
    handle = kv.acquire_prefix(tokens, limit=len(tokens) - 1)
    kv.allocate("r", 11)
    handle = kv.commit("r", tokens, handle)
    assert handle.prefix_len == 40
    assert check(kv) == (59, 0, 40, 1)
    kv.release("r", handle)
    assert check(kv) == (60, 40, 0, 0)


def test_concurrent_duplicate_commit_frees_the_duplicated_tokens() -> None:
    """Two requests computed the same prompt at once; the second commit keeps one copy."""
    kv = make_kv(200)
    prompt = seq(1, 40)
    hx = kv.acquire_prefix(prompt, limit=39)
    hy = kv.acquire_prefix(prompt, limit=39)
    assert hx.prefix_len == hy.prefix_len == 0
    kv.allocate("x", 41)
    kv.allocate("y", 41)
    assert check(kv) == (118, 0, 0, 82)
    hx = kv.commit("x", prompt, hx)
    assert check(kv) == (118, 0, 40, 42)
    hy = kv.commit("y", prompt, hy)
    assert check(kv) == (158, 0, 40, 2)  # y's 40 duplicated tokens went back to free
    assert kv.allocator.held("y") == 1 and hy.prefix_len == 40
    kv.release("x", hx)
    assert check(kv) == (159, 0, 40, 1)  # still locked by y
    kv.release("y", hy)
    assert check(kv) == (160, 40, 0, 0)


def test_partially_overlapping_commit_frees_only_the_overlap() -> None:
    kv = make_kv(200)
    first, second = seq(1, 40), seq(1, 25) + seq(900, 15)
    hx, hy = kv.acquire_prefix(first, limit=40), kv.acquire_prefix(second, limit=40)
    kv.allocate("x", 40)
    kv.allocate("y", 40)
    hx = kv.commit("x", first, hx)
    hy = kv.commit("y", second, hy)
    assert kv.tree.total_tokens == 55  # 25 shared + 15 + 15
    assert kv.allocator.held("y") == 0
    assert check(kv) == (145, 0, 55, 0)
    kv.release("x", hx)
    assert check(kv) == (145, 15, 40, 0)  # only x's own branch became evictable
    kv.release("y", hy)
    assert check(kv) == (145, 55, 0, 0)


def test_release_frees_private_tokens_and_unlocks() -> None:
    kv = make_kv(100)
    cache(kv, "x", seq(1, 30))
    handle = kv.acquire_prefix(seq(1, 30) + seq(300, 10), limit=39)
    kv.allocate("r", 25)  # e.g. a retracted request: computed chunks never committed
    assert check(kv) == (45, 0, 30, 25)
    kv.release("r", handle)
    assert check(kv) == (70, 30, 0, 0)
    with pytest.raises(ValueError):
        kv.release("r", handle)  # unlocking twice is an error, not a silent miscount


def _cache_claims_more_than_the_tree(kv: PrefixKVCache) -> None:
    kv.allocator.allocate(CACHE, 5)


def _tree_grows_without_memory(kv: PrefixKVCache) -> None:
    kv.tree.insert(seq(700, 5))


def _allocator_loses_a_token(kv: PrefixKVCache) -> None:
    kv.allocator._free -= 1


def _tree_miscounts_evictable(kv: PrefixKVCache) -> None:
    kv.tree._evictable_tokens += 1


@pytest.mark.parametrize(
    "corrupt",
    [
        _cache_claims_more_than_the_tree,
        _tree_grows_without_memory,
        _allocator_loses_a_token,
        _tree_miscounts_evictable,
    ],
)
def test_check_invariants_catches_corruption(corrupt) -> None:
    kv = make_kv(100)
    cache(kv, "x", seq(1, 30))
    handle = kv.acquire_prefix(seq(1, 30) + seq(300, 10), limit=39)
    kv.allocate("r", 11)
    check(kv)
    corrupt(kv)
    with pytest.raises(AssertionError):
        kv.check_invariants()
    assert handle.prefix_len == 30


# ---------------------------------------------------------------- random lifecycles

# Prompts drawn from a few shared prefixes so that matches, splits and duplicates happen.
PREFIXES = (seq(1, 12), seq(1, 6) + seq(50, 6), seq(100, 9))
cache_ops = st.lists(
    st.tuples(
        st.sampled_from(("admit", "commit", "release", "grow")),
        st.integers(0, 3),  # owner
        st.integers(0, len(PREFIXES) - 1),  # prefix
        st.integers(0, 8),  # suffix length (admit) / tokens to grow
    ),
    max_size=50,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(capacity=st.integers(10, 80), ops=cache_ops)
def test_random_request_lifecycles_conserve_memory_and_respect_locks(
    capacity: int, ops: list[tuple[str, int, int, int]]
) -> None:
    """Admit (lock + allocate) / commit / grow / release in any order, as a scheduler would.

    The model tracks each owner's private tokens; after every operation the cache must agree,
    the equation must hold, and every owner's locked prefix must still be fully cached.
    """
    kv = make_kv(capacity)
    active: dict[int, tuple[PrefixHandle, tuple[int, ...]]] = {}
    private = dict.fromkeys(range(4), 0)
    suffix_ids = iter(range(10_000, 1_000_000))
    for op, owner, prefix, n in ops:
        if op == "admit" and owner not in active:
            tokens = PREFIXES[prefix] + tuple(next(suffix_ids) for _ in range(n))
            handle = kv.acquire_prefix(tokens, limit=len(tokens))
            need = len(tokens) - handle.prefix_len
            if kv.can_allocate(owner, need):
                kv.allocate(owner, need)
                private[owner] += need
                active[owner] = (handle, tokens)
            else:
                kv.tree.unlock(handle.node)  # as the scheduler does when a request won't fit
        elif op == "commit" and owner in active:
            handle, tokens = active[owner]
            before_tree = kv.tree.total_tokens
            new = kv.commit(owner, tokens, handle)
            assert new.prefix_len == len(tokens)
            # Private shrinks by exactly the uncommitted part: moved or freed as duplicate.
            private[owner] -= len(tokens) - handle.prefix_len
            assert kv.tree.total_tokens - before_tree <= len(tokens) - handle.prefix_len
            active[owner] = (new, tokens)
        elif op == "grow" and owner in active:
            if kv.can_allocate(owner, n):
                kv.allocate(owner, n)
                private[owner] += n
            else:
                with pytest.raises(OutOfMemory):
                    kv.allocate(owner, n)
        elif op == "release" and owner in active:
            handle, _ = active.pop(owner)
            kv.release(owner, handle)
            private[owner] = 0
        check(kv)
        assert all(kv.allocator.held(o) == private[o] for o in private)
        assert kv.usage().private == sum(private.values())
        for handle, tokens in active.values():
            assert kv.match_len(tokens) >= handle.prefix_len, "a locked prefix was evicted"
    for owner, (handle, _) in list(active.items()):
        kv.release(owner, handle)
    usage = check(kv)
    assert usage[2] == usage[3] == 0  # nothing locked, nothing private
