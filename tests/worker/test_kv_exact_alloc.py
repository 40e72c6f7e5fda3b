"""Exact KV slots piece by piece: slot ids in the token allocator, freeing named slots (holes) in
the block layouts, the bidirectional copy journal, and ``PrefixKVCache(exact=True)``'s commit,
eviction, flush and ``kv_slots``. ``test_kv_exact.py`` proves the whole under the scheduler."""

from __future__ import annotations

import pytest

from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker.engine import KVCopy
from sgl_fair.worker.kv import (
    CACHE,
    BidirectionalAllocator,
    PagedAllocator,
    PrefixKVCache,
    TokenAllocator,
)
from sgl_fair.worker.kv.bidirectional import BE, RT
from sgl_fair.worker.scheduler import Scheduler

S = 8


# ---------------------------------------------------------------- token allocator


def test_token_allocator_counts_only_unless_exact() -> None:
    alloc = TokenAllocator(8)
    assert not alloc.exact and alloc.block_size == 1
    with pytest.raises(ValueError, match="exact"):
        alloc.flat_slots("a")
    alloc.allocate("a", 2)
    with pytest.raises(ValueError, match="holds tokens"):
        alloc.enable_exact()


def test_token_allocator_slot_ids_follow_every_operation() -> None:
    alloc = TokenAllocator(8, exact=True)
    alloc.allocate("a", 3)
    alloc.allocate("b", 2)
    assert alloc.flat_slots("a") == [0, 1, 2] and alloc.flat_slots("b") == [3, 4]
    alloc.transfer("a", CACHE, 2)  # its first two
    assert alloc.flat_slots(CACHE) == [0, 1] and alloc.flat_slots("a") == [2]
    alloc.free("b", 1)  # its last
    assert alloc.flat_slots("b") == [3]
    alloc.free_slots(CACHE, [0])
    assert alloc.flat_slots(CACHE) == [1] and alloc.held(CACHE) == 1
    with pytest.raises(ValueError, match="does not hold"):
        alloc.free_slots("a", [1])
    alloc.allocate("c", 3)  # reuses freed ids
    assert alloc.flat_slots("c") == [0, 4, 5]
    alloc.check_invariants()
    for owner in ("a", "b", "c", CACHE):
        alloc.free(owner)
    assert alloc.num_free_tokens() == 8 and not alloc.owners()
    alloc.check_invariants()


# ---------------------------------------------------------------- block layouts: holes


def test_paged_free_slots_cuts_inner_outer_and_middle_runs() -> None:
    alloc = PagedAllocator(4 * S, block_size=S)
    alloc.allocate("a", 12)  # block 0 full, block 1 slots 0..3
    assert alloc.flat_slots("a") == list(range(12))
    alloc.free_slots("a", [0, 1])  # outer end of block 0: a hole
    alloc.free_slots("a", [4, 5])  # a middle run: block 0 splits in two pieces
    alloc.free_slots("a", [11])  # the inner end
    assert alloc.flat_slots("a") == [2, 3, 6, 7, 8, 9, 10]
    assert alloc.held("a") == 7 and alloc.num_fragmented_tokens() == 4 + 5
    alloc.check_invariants()
    alloc.allocate("a", 2)  # grows after its innermost piece, never into the holes
    assert alloc.flat_slots("a")[-2:] == [11, 12]
    alloc.free_slots("a", [2, 3, 6, 7])  # block 0 empties: back to the free blocks
    assert 0 in alloc.layout.free_blocks
    alloc.check_invariants()


def test_paged_hole_below_a_handed_over_piece() -> None:
    alloc = PagedAllocator(2 * S, block_size=S)
    alloc.allocate("a", 6)
    alloc.transfer("a", CACHE, 2)  # [C C a a a a . .]
    alloc.free_slots("a", [2])  # a's leading token: [C C _ a a a . .]
    alloc.allocate("a", 2)  # still grows in place: its piece is innermost
    assert alloc.flat_slots("a") == [3, 4, 5, 6, 7] and alloc.flat_slots(CACHE) == [0, 1]
    alloc.free("a")
    alloc.free_slots(CACHE, [0, 1])
    assert alloc.num_free_tokens() == 2 * S
    alloc.check_invariants()


def test_blocks_freed_by_named_slots() -> None:
    alloc = PagedAllocator(3 * S, block_size=S)
    alloc.allocate("a", 2 * S)
    alloc.transfer("a", CACHE, 2 * S)
    assert alloc.layout.blocks_freed_by(CACHE, 0, slots=list(range(S, 2 * S))) == 1
    assert alloc.layout.blocks_freed_by(CACHE, 0, slots=list(range(1, S + 1))) == 0
    assert alloc.can_allocate_after_free("b", 2 * S, CACHE, 0, slots=list(range(S)))
    assert not alloc.can_allocate_after_free("b", 2 * S, CACHE, 0, slots=[0])


# ---------------------------------------------------------------- bidirectional: journal


def test_bidirectional_journal_checkpoints_and_restores_in_order() -> None:
    alloc = BidirectionalAllocator(2 * S, block_size=S)
    alloc.record_copies()
    alloc.allocate("be", 6, request_class=BE)  # block 0 slots 2..7 (read right to left)
    be_slots = alloc.flat_slots("be")
    alloc.allocate("other", S, request_class=BE)  # block 1: no free block is left
    alloc.allocate("rt", 4, request_class=RT)  # overwrites be's 2 innermost slots (2, 3)
    ckpt = alloc.checkpoints("be")
    assert alloc.drain_copies() == [
        KVCopy(True, c.host_offset, 0, c.slot, c.num_tokens) for c in ckpt
    ]
    assert [(c.slot, c.num_tokens) for c in ckpt] == [(2, 2)] and alloc.drain_copies() == []
    alloc.free("other")
    ops = alloc.restore("be")
    assert alloc.drain_copies() == [KVCopy(False, *op) for op in ops]
    # Contents: be's tokens written where flat_slots said, copied as journaled, read back.
    device = {s: ("be", p) for p, s in enumerate(be_slots)}
    host = {}
    for c in [KVCopy(True, ckpt[0].host_offset, 0, 2, 2)] + [KVCopy(False, *op) for op in ops]:
        for i in range(c.num_tokens):
            if c.to_host:
                host[c.host_offset + i] = device[c.block * S + c.slot + i]
            else:
                device[c.block * S + c.slot + i] = host[c.host_offset + i]
    assert [device[s] for s in alloc.flat_slots("be")] == [("be", p) for p in range(6)]
    alloc.check_invariants()


def test_bidirectional_middle_cut_keeps_the_checkpoint_on_the_inner_part() -> None:
    alloc = BidirectionalAllocator(1 * S, block_size=S)
    alloc.allocate("be", 8, request_class=BE)
    alloc.allocate("rt", 2, request_class=RT)  # be's tokens 6, 7 go to host
    alloc.free_slots("be", [5, 4])  # be's tokens 2, 3: a middle run of its piece
    assert alloc.checkpointed_slots("be") == 2 and alloc.flat_slots("be") == [7, 6, 3, 2]
    alloc.check_invariants()


def test_no_journal_unless_recording() -> None:
    alloc = BidirectionalAllocator(S, block_size=S)
    alloc.allocate("be", 8, request_class=BE)
    alloc.allocate("rt", 2, request_class=RT)
    assert alloc.drain_copies() == []


# ---------------------------------------------------------------- PrefixKVCache(exact=True)


@pytest.mark.parametrize(
    "alloc",
    [
        TokenAllocator(64),
        PagedAllocator(64, block_size=4),
        BidirectionalAllocator(64, block_size=4),
    ],
    ids=["token", "paged", "bidirectional"],
)
def test_commit_frees_the_leading_duplicates_and_records_the_rest(alloc) -> None:
    kv = PrefixKVCache(alloc, exact=True)
    prompt = tuple(range(1, 11))
    a, b = object(), object()
    ha = kv.acquire_prefix(prompt, limit=9)
    hb = kv.acquire_prefix(prompt, limit=9)  # nothing cached yet: both compute it all
    kv.allocate(a, 11)
    kv.allocate(b, 11)
    a_slots, b_slots = alloc.flat_slots(a), alloc.flat_slots(b)
    ha = kv.commit(a, prompt, ha)
    assert ha.node.slots == a_slots[:10] and kv.kv_slots(a, ha) == a_slots
    hb = kv.commit(b, prompt[:6] + (99,) * 4, hb)  # 6 duplicated, 4 new
    assert hb.node.slots == b_slots[6:10]
    assert kv.kv_slots(b, hb) == a_slots[:6] + b_slots[6:]
    assert alloc.flat_slots(b) == [b_slots[10]]  # the duplicated leading six are free
    kv.check_invariants()
    kv.release(a, ha)
    kv.release(b, hb)
    kv._evict(4)  # whichever leaf goes, exactly its slots go (tree slots == CACHE's)
    kv.check_invariants()
    if isinstance(alloc, TokenAllocator):
        assert kv.flush() and alloc.num_free_tokens() == 64
    else:
        kv._evict(kv.tree.total_tokens)
        assert alloc.num_free_tokens() == 64
    kv.check_invariants()


def test_split_edges_split_their_slots() -> None:
    kv = PrefixKVCache(TokenAllocator(32), exact=True)
    a = object()
    h = kv.acquire_prefix((1, 2, 3, 4, 5), limit=4)
    kv.allocate(a, 5)
    h = kv.commit(a, (1, 2, 3, 4, 5), h)
    slots = h.node.slots
    h2 = kv.acquire_prefix((1, 2, 3, 9), limit=3)  # splits (1..5) after 3 tokens
    assert h2.prefix_len == 3 and h2.node.slots == slots[:3] and h.node.slots == slots[3:]
    assert kv.kv_slots(object(), h2) == slots[:3]
    kv.check_invariants()


def test_count_mode_is_untouched() -> None:
    kv = PrefixKVCache(TokenAllocator(32))
    h = kv.acquire_prefix((1, 2, 3), limit=2)
    kv.allocate("a", 3)
    h = kv.commit("a", (1, 2, 3), h)
    assert h.node.slots is None and kv.drain_copies() == []
    with pytest.raises(ValueError, match="exact"):
        kv.kv_slots("a", h)
    sched = Scheduler(policy=make_policy("fcfs"), kv=PrefixKVCache(TokenAllocator(64)))
    sched.add_request(Request("r", "c", (1, 2, 3), 2, 0.0), 0.0)
    assert sched.step(0.0).kv_copies == ()


def test_exact_needs_slot_capable_allocator_and_empty_tree() -> None:
    class Counting:
        pass

    with pytest.raises(ValueError, match="exact"):
        PrefixKVCache(Counting(), exact=True)  # type: ignore[arg-type]
