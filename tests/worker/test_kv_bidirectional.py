"""BidirectionalAllocator (BROS §5): placement rules by hand, then random RT/BE workloads in
which an engine stand-in moves real token ids exactly as the allocator's tables say.

The stand-in writes each new token where ``slot_mapping`` puts it, copies checkpointed slots to
host (``preemption_table``) before an RT overwrites them, and performs ``restore``'s copies; after
every operation each request must read back exactly its own tokens, in order.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.worker.kv import (
    CACHE,
    BidirectionalAllocator,
    KVAllocator,
    OutOfMemory,
    PrefixKVCache,
)
from sgl_fair.worker.kv.bidirectional import BE, RT, BlockEntry, Checkpoint, CopyOp

S = 8  # block size of the hand-built cases


def make(num_blocks: int, *, host_blocks: int | None = None) -> BidirectionalAllocator:
    host = None if host_blocks is None else host_blocks * S
    return BidirectionalAllocator(num_blocks * S, block_size=S, host_capacity_tokens=host)


def fill(alloc: BidirectionalAllocator, cls: str, sizes: dict[str, int]) -> None:
    for owner, n in sizes.items():
        alloc.allocate(owner, n, request_class=cls)
    alloc.check_invariants()


# ---------------------------------------------------------------- classes and the seam


def test_is_a_kv_allocator_with_rt_and_be_classes() -> None:
    alloc = make(2)
    assert isinstance(alloc, KVAllocator) and alloc.capacity_tokens == 16
    assert alloc.class_of("new") == BE and alloc.class_of(CACHE) == BE
    with pytest.raises(ValueError, match="'rt' or 'be'"):
        alloc.set_class("r", "urgent")
    alloc.allocate("r", 3, request_class=RT)
    with pytest.raises(ValueError, match="free it first"):
        alloc.set_class("r", BE)
    with pytest.raises(ValueError, match="still holds"):
        alloc.forget("r")
    alloc.free("r")
    assert alloc.class_of("r") == RT  # kept: PrefixKVCache allocates without a class
    alloc.forget("r")
    assert alloc.class_of("r") == BE


def test_rt_fills_from_the_left_and_be_from_the_right_of_one_block() -> None:
    alloc = make(1)
    fill(alloc, RT, {"r": 3})
    fill(alloc, BE, {"b": 5})
    assert alloc.block_table("r") == [BlockEntry(0, 0, 3)]
    assert alloc.block_table("b") == [BlockEntry(0, 1, 5)]
    assert alloc.slot_mapping("r") == [(0, 0), (0, 1), (0, 2)]
    assert alloc.slot_mapping("b") == [(0, 7), (0, 6), (0, 5), (0, 4), (0, 3)]
    assert alloc.num_free_tokens() == 0 and not alloc.can_allocate("b", 1)


# ---------------------------------------------------------------- placement


def test_be_prefill_takes_the_blocks_with_the_most_empty_slots() -> None:
    alloc = make(4)
    fill(alloc, RT, {"r0": 6, "r1": 2, "r2": 4, "r3": 7})  # blocks 0..3, no free block left
    alloc.allocate("b", 5)
    assert alloc.block_table("b") == [BlockEntry(1, 1, 5)]  # 6 empty slots: the most
    alloc.allocate("c", 7)
    assert alloc.block_table("c") == [BlockEntry(2, 1, 4), BlockEntry(0, 1, 2), BlockEntry(3, 1, 1)]
    assert not alloc.can_allocate("d", 1)  # every right side is taken
    assert alloc.can_allocate("b", 1) and not alloc.can_allocate("b", 2)  # b's room in block 1
    alloc.check_invariants()


def test_a_growing_request_continues_in_its_last_block_then_takes_a_free_one() -> None:
    alloc = make(3)
    fill(alloc, BE, {"b": 5})
    alloc.allocate("b", 3)
    assert alloc.block_table("b") == [BlockEntry(0, 1, 8)]
    alloc.allocate("b", 1)
    assert alloc.block_table("b") == [BlockEntry(0, 1, 8), BlockEntry(1, 1, 1)]
    fill(alloc, RT, {"r": 7})
    alloc.allocate("r", 2)  # its last slot in block 2; no free block: block 1 (7 empty slots)
    assert alloc.block_table("r") == [BlockEntry(2, 0, 8), BlockEntry(1, 0, 1)]
    assert alloc.checkpointed_slots("b") == 0  # block 1 had 7 empty slots: nothing overwritten
    alloc.check_invariants()


def test_rt_preempts_the_emptiest_be_only_block_and_checkpoints_only_what_it_overwrites() -> None:
    alloc = make(4)
    fill(alloc, BE, {"b0": 8, "b1": 3, "b2": 5, "b3": 8})  # blocks 0..3, full / 5 / 3 / 0 empty
    alloc.allocate("r", 2, request_class=RT)
    assert alloc.block_table("r") == [BlockEntry(1, 0, 2)]  # block 1: the most empty slots
    alloc.allocate("r", 3)  # the rest of the empty slots: no checkpoint yet
    assert alloc.preemption_table() == {} and alloc.host_used_tokens() == 0
    alloc.allocate("r", 2)  # now it meets b1: b1's 2 innermost (newest) slots go to host
    assert alloc.checkpoints("b1") == [Checkpoint(1, 5, 2, host_offset=5)]
    assert alloc.held("b1") == 1 and alloc.checkpointed_slots("b1") == 2
    assert alloc.slot_mapping("b1") == [(1, 7)]  # its oldest token, untouched
    assert alloc.host_used_tokens() == 2 and alloc.num_free_tokens() == 3  # block 2's
    assert [alloc.checkpointed_slots(b) for b in ("b0", "b2", "b3")] == [0, 0, 0]
    assert not alloc.can_allocate("b1", 1)  # checkpointed: it must be restored first
    alloc.allocate("r", 2)  # b1's last slot, then the next emptiest BE-only block (block 2)
    assert alloc.checkpoints("b1") == [Checkpoint(1, 5, 3, host_offset=5)]
    assert alloc.block_table("b1") == [] and alloc.held("b1") == 0
    assert alloc.block_table("r") == [BlockEntry(1, 0, 8), BlockEntry(2, 0, 1)]
    assert alloc.checkpointed_slots("b2") == 0  # block 2 had 3 empty slots
    alloc.check_invariants()
    # No block is free: restoring needs a fresh right side somewhere.
    assert alloc.restore_plan("b1") is None
    with pytest.raises(OutOfMemory):
        alloc.restore("b1")
    alloc.free("r")
    plan = alloc.restore_plan("b1")
    assert plan == [CopyOp(host_offset=5, block=1, slot=5, num_tokens=3)]
    assert alloc.restore("b1") == plan
    assert alloc.block_table("b1") == [BlockEntry(1, 1, 3)] and alloc.held("b1") == 3
    assert alloc.host_used_tokens() == 0 and alloc.preemption_table() == {}
    alloc.check_invariants()


def test_a_restore_split_over_two_blocks_reads_back_in_order() -> None:
    alloc = make(3)
    engine = Engine(alloc)
    be_tokens = [f"t{i}" for i in range(8)]
    engine.allocate("b", be_tokens, BE)  # block 0, t0 at slot 7 ... t7 at slot 0
    engine.allocate("r1", ["x"] * 5, RT)  # blocks 1 and 2: 3 empty slots each
    engine.allocate("r2", ["y"] * 5, RT)
    engine.allocate("r0", ["z"] * 5, RT)  # preempts block 0: t3..t7 go to host
    assert alloc.checkpoints("b") == [Checkpoint(0, 0, 5, host_offset=0)]
    assert engine.read("b") == be_tokens[:3]
    assert engine.read_host("b") == ["t7", "t6", "t5", "t4", "t3"]  # mirrored: slot 0 first
    alloc.free("b", 1)  # its newest token, t7, lives on the host: only the host copy goes
    assert alloc.checkpoints("b") == [Checkpoint(0, 1, 4, host_offset=1)]
    ops = engine.restore("b")  # oldest first: t3..t5 to block 1, t6 to block 2
    assert ops == [CopyOp(2, 1, 5, 3), CopyOp(1, 2, 7, 1)]
    assert engine.read("b") == be_tokens[:7]
    assert alloc.block_table("b") == [BlockEntry(0, 1, 3), BlockEntry(1, 1, 3), BlockEntry(2, 1, 1)]
    alloc.check_invariants()


def test_host_memory_bounds_checkpoints_and_dropping_makes_room() -> None:
    alloc = make(4, host_blocks=1)
    fill(alloc, BE, {"b0": 8, "b1": 8, "b2": 8, "b3": 8})
    alloc.allocate("r", 8, request_class=RT)  # all of block 0: one host block
    assert alloc.checkpointed_slots("b0") == 8 and alloc.host_used_tokens() == 8
    assert not alloc.can_allocate("r", 1)  # the next block needs a second host block
    with pytest.raises(OutOfMemory):
        alloc.allocate("r", 1)
    assert alloc.victims_for(1, owner="r") == ["b1"]  # largest first (b0 is resident-empty)
    least_urgent = {"b1": 2.0, "b2": 0.5, "b3": 1.0}.get
    assert alloc.victims_for(1, owner="r", urgency=lambda o: least_urgent(o, 9)) == ["b2"]
    assert alloc.victims_for(40, owner="r") is None  # more than the device
    # b0 holds no device slot, but dropping it frees the host block r needs to go on.
    assert alloc.victims_for(1, owner="r", urgency=lambda o: o != "b0") == ["b0"]
    assert alloc.drop("b2") == 8
    assert alloc.can_allocate("r", 8) and not alloc.can_allocate("r", 9)
    alloc.allocate("r", 8)
    assert alloc.block_table("r") == [BlockEntry(0, 0, 8), BlockEntry(2, 0, 8)]
    alloc.check_invariants()


def test_drop_frees_resident_and_checkpointed_tokens() -> None:
    alloc = make(2)
    fill(alloc, BE, {"b": 8, "c": 8})
    alloc.allocate("r", 3, request_class=RT)
    alloc.free("c")
    assert alloc.held("b") == 5 and alloc.checkpointed_slots("b") == 3
    assert alloc.drop("b") == 8
    assert alloc.owners() == ["r"] and alloc.host_used_tokens() == 0
    assert alloc.num_free_tokens() == 13
    assert alloc.drop("r") == 3 and alloc.class_of("r") == BE  # its class is forgotten too
    assert alloc.num_free_tokens() == 16
    with pytest.raises(ValueError, match="never dropped"):
        alloc.drop(CACHE)
    alloc.check_invariants()


# ---------------------------------------------------------------- CACHE


def test_tokens_handed_to_cache_stay_in_place_and_are_never_overwritten() -> None:
    alloc = make(1)
    fill(alloc, BE, {"b": 6})
    alloc.transfer("b", CACHE, 4)  # slots 7..4 are the cache's now; b keeps 3, 2
    assert alloc.slot_mapping(CACHE) == [(0, 7), (0, 6), (0, 5), (0, 4)]
    assert alloc.slot_mapping("b") == [(0, 3), (0, 2)] and alloc.num_free_tokens() == 2
    alloc.allocate("r", 4, request_class=RT)  # 2 empty slots, then b's 2 (checkpointed)
    assert alloc.checkpointed_slots("b") == 2 and alloc.held(CACHE) == 4
    assert not alloc.can_allocate("r", 1)  # CACHE is pinned
    assert alloc.victims_for(1, owner="r") is None  # and never a victim
    with pytest.raises(ValueError, match="resident"):
        alloc.transfer("b", CACHE, 1)  # b's next tokens are on the host
    with pytest.raises(ValueError, match="CACHE only"):
        alloc.transfer("r", "other", 1)
    alloc.check_invariants()


def test_a_checkpointed_request_may_hand_its_resident_head_to_cache() -> None:
    alloc = make(2)
    engine = Engine(alloc)
    engine.allocate("b", [f"t{i}" for i in range(8)], BE)
    engine.allocate("c", ["c"] * 8, BE)
    engine.allocate("r", ["r"] * 3, RT)  # overwrites b's newest 3
    alloc.transfer("b", CACHE, 5)  # all that is resident; the checkpoint stays b's
    assert engine.read(CACHE) == [f"t{i}" for i in range(5)] and engine.read("b") == []
    assert alloc.checkpoints("b") == [Checkpoint(0, 0, 3, host_offset=0)]
    alloc.check_invariants()
    alloc.free("c")
    engine.restore("b")
    assert engine.read("b") == ["t5", "t6", "t7"]
    assert alloc.block_table("b") == [BlockEntry(1, 1, 3)]
    alloc.check_invariants()


def test_prefix_cache_runs_over_bidirectional_blocks() -> None:
    kv = PrefixKVCache(make(4))
    prompt = tuple(range(1, 11))
    kv.allocator.set_class("x", RT)
    handle = kv.acquire_prefix(prompt, limit=9)
    kv.allocate("x", 11)
    handle = kv.commit("x", prompt, handle)
    assert kv.allocator.held(CACHE) == 10 and kv.allocator.held("x") == 1
    assert kv.allocator.block_table("x") == [BlockEntry(1, 0, 1)]  # behind the cached head
    kv.check_invariants()
    kv.release("x", handle)
    assert tuple(kv.usage()) == (22, 10, 0, 0)
    handle = kv.acquire_prefix(prompt + (99,), limit=11)
    assert handle.prefix_len == 10
    kv.allocate("y", 1)
    kv.release("y", kv.commit("y", prompt + (99,), handle))
    kv.check_invariants()
    assert kv.allocator.held(CACHE) == kv.tree.total_tokens == 11


PREFIXES = (tuple(range(1, 13)), tuple(range(1, 7)) + tuple(range(50, 56)), tuple(range(100, 109)))
cache_ops = st.lists(
    st.tuples(
        st.sampled_from(("admit", "commit", "release", "grow")),
        st.integers(0, 3),  # owner: even ones are RT
        st.integers(0, 2),  # prefix
        st.integers(0, 9),  # suffix length (admit) / tokens to grow
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 4, 5]), ops=cache_ops)
def test_random_prefix_cache_lifecycles_over_bidirectional_blocks(
    num_blocks: int, block_size: int, ops: list[tuple[int, ...]]
) -> None:
    """The radix cache over RT and BE requests: whatever it admits or refuses, the tree and
    the blocks agree, locked prefixes stay, and a refusal changes no request's tokens."""
    alloc = BidirectionalAllocator(num_blocks * block_size, block_size=block_size)
    kv = PrefixKVCache(alloc)
    active: dict[int, tuple] = {}
    suffix_ids = iter(range(10_000, 1_000_000))
    for op, owner, prefix, n in ops:
        alloc.set_class(owner, RT if owner % 2 == 0 else BE)
        if op == "admit" and owner not in active:
            tokens = PREFIXES[prefix] + tuple(next(suffix_ids) for _ in range(n))
            handle = kv.acquire_prefix(tokens, limit=len(tokens))
            if grew(kv, owner, len(tokens) - handle.prefix_len):
                active[owner] = (handle, tokens)
            else:
                kv.tree.unlock(handle.node)
        elif op == "commit" and owner in active and not alloc.checkpointed_slots(owner):
            handle, tokens = active[owner]
            active[owner] = (kv.commit(owner, tokens, handle), tokens)
        elif op == "grow" and owner in active:
            grew(kv, owner, n)
        elif op == "release" and owner in active:
            kv.release(owner, active.pop(owner)[0])
            assert alloc.logical_len(owner) == 0
        kv.check_invariants()
        for handle, tokens in active.values():
            assert kv.match_len(tokens) >= handle.prefix_len, "a locked prefix was evicted"
    for owner, (handle, _) in list(active.items()):
        kv.release(owner, handle)
    kv.check_invariants()
    assert alloc.held(CACHE) == kv.tree.total_tokens and kv.usage().private == 0


def grew(kv: PrefixKVCache, owner: int, n: int) -> bool:
    """``kv.allocate``; it counts tokens, so it may refuse what preemption could give (RT over
    BE) or promise what the blocks' layout cannot; then the blocks must truly lack room."""
    before, promised = kv.allocator.logical_len(owner), kv.can_allocate(owner, n)
    try:
        kv.allocate(owner, n)
    except OutOfMemory:
        assert not promised or not kv.allocator.can_allocate(owner, n)
        assert kv.allocator.logical_len(owner) == before
        return False
    assert kv.allocator.logical_len(owner) == before + n
    return True


# ---------------------------------------------------------------- random workloads


class Engine:
    """Token ids in device and host slots, moved only as the allocator's tables direct."""

    def __init__(self, alloc: BidirectionalAllocator) -> None:
        self.alloc = alloc
        self.device: dict[tuple[int, int], object] = {}
        self.host: dict[int, object] = {}

    def _checkpoints(self) -> dict[tuple[object, int], Checkpoint]:
        return {
            (owner, c.host_offset - c.slot): c
            for owner, entries in self.alloc.preemption_table().items()
            for c in entries
        }

    def allocate(self, owner: object, tokens: list[object], cls: str) -> None:
        before = self._checkpoints()
        self.alloc.allocate(owner, len(tokens), request_class=cls)
        for key, c in self._checkpoints().items():  # save what is about to be overwritten
            done = before[key].num_tokens if key in before else 0
            assert key not in before or before[key].slot == c.slot, "a checkpoint moved"
            for i in range(done, c.num_tokens):
                self.host[c.host_offset + i] = self.device[(c.block, c.slot + i)]
        if tokens:  # the new tokens are the owner's last resident ones
            slots = self.alloc.slot_mapping(owner)[-len(tokens) :]
            self.device.update(zip(slots, tokens, strict=True))

    def restore(self, owner: object) -> list[CopyOp]:
        ops = self.alloc.restore(owner)
        for op in ops:
            for i in range(op.num_tokens):
                self.device[(op.block, op.slot + i)] = self.host[op.host_offset + i]
        return ops

    def read(self, owner: object) -> list[object]:
        return [self.device[where] for where in self.alloc.slot_mapping(owner)]

    def read_host(self, owner: object) -> list[object]:
        return [
            self.host[c.host_offset + i]
            for c in self.alloc.checkpoints(owner)
            for i in range(c.num_tokens)
        ]


CLASSES = {"r0": RT, "r1": RT, "b0": BE, "b1": BE, "b2": BE}
# Repeats weight the draw: growth and restores are what make blocks meet.
OPS = ("alloc",) * 4 + ("restore",) * 2 + ("free", "commit", "uncache", "drop", "make_room")
workload_ops = st.lists(
    st.tuples(st.sampled_from(OPS), st.sampled_from(sorted(CLASSES)), st.integers(0, 12)),
    min_size=20,
    max_size=80,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4, 8]),
    host_blocks=st.sampled_from([0, 1, 2, None]),
    be_prefill=st.lists(st.integers(0, 20), min_size=3, max_size=3),
    ops=workload_ops,
)
def test_random_rt_be_workloads_keep_every_token_where_the_tables_say(
    num_blocks: int,
    block_size: int,
    host_blocks: int | None,
    be_prefill: list[int],
    ops: list[tuple[str, str, int]],
) -> None:
    host = None if host_blocks is None else host_blocks * block_size
    alloc = BidirectionalAllocator(
        num_blocks * block_size, block_size=block_size, host_capacity_tokens=host
    )
    engine = Engine(alloc)
    model: dict[str, list[object]] = {owner: [] for owner in CLASSES}
    cache: list[object] = []  # the tokens CACHE holds, in hand-over order
    ids = itertools.count()
    # BE requests fill the pool first (as a throughput backlog would), then anything goes.
    prefill = [("alloc", owner, n) for owner, n in zip(("b0", "b1", "b2"), be_prefill, strict=True)]
    for op, owner, n in prefill + ops:
        cls, tokens = CLASSES[owner], model[owner]
        if op == "alloc":
            ok = alloc.can_allocate(owner, n, request_class=cls)
            assert ok or n > 0, "zero tokens always fit"
            if cls == BE and alloc.checkpointed_slots(owner) and n:
                assert not ok, "a checkpointed BE request grew before its restore"
            if ok:
                new = [(owner, next(ids)) for _ in range(n)]
                engine.allocate(owner, new, cls)
                tokens += new
            else:
                with pytest.raises(OutOfMemory):
                    alloc.allocate(owner, n, request_class=cls)
        elif op == "free":
            k = min(n, len(tokens))
            alloc.free(owner, k)
            del tokens[len(tokens) - k :]
        elif op == "commit":
            k = min(n, alloc.held(owner))
            try:
                alloc.transfer(owner, CACHE, k)
            except ValueError:
                assert alloc.checkpointed_slots(owner), "refused a resident hand-over"
            else:
                cache += tokens[:k]
                del tokens[:k]
        elif op == "uncache":
            k = min(n, len(cache))
            alloc.free(CACHE, k)
            del cache[len(cache) - k :]
        elif op == "restore":
            plan = alloc.restore_plan(owner)
            if plan is None:
                with pytest.raises(OutOfMemory):
                    alloc.restore(owner)
            else:
                assert engine.restore(owner) == plan
                assert alloc.checkpointed_slots(owner) == 0
        elif op == "drop":
            assert alloc.drop(owner) == len(tokens)
            tokens.clear()
        else:  # make_room: drop the suggested victims, then the allocation must fit
            alloc.set_class(owner, cls)
            victims = alloc.victims_for(n, owner=owner)
            if victims is None:
                assert not alloc.can_allocate(owner, n)
            else:
                assert CACHE not in victims and owner not in victims
                classes = [CLASSES[v] for v in victims]
                assert classes == sorted(classes, key=lambda c: c == RT), "BE victims first"
                for victim in victims:
                    assert alloc.drop(victim) == len(model[victim])
                    model[victim].clear()
                assert alloc.can_allocate(owner, n)
                new = [(owner, next(ids)) for _ in range(n)]
                engine.allocate(owner, new, cls)
                tokens += new
        alloc.check_invariants()
        for o, toks in model.items():
            assert alloc.logical_len(o) == len(toks)
            resident, saved = engine.read(o), engine.read_host(o)
            if CLASSES[o] == RT or not saved:
                assert resident == toks and not saved  # RT is never checkpointed
            else:
                assert sorted(resident + saved, key=toks.index) == toks
                positions = [toks.index(t) for t in resident]
                assert positions == sorted(positions), "resident tokens out of order"
        assert engine.read(CACHE) == cache


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(1, 8),
    block_size=st.sampled_from([1, 4, 8]),
    host_blocks=st.sampled_from([0, 1, 2, None]),
    ops=workload_ops,
)
def test_room_freed_by_dropping_a_be_request_is_exact(
    num_blocks: int, block_size: int, host_blocks: int | None, ops: list[tuple[str, str, int]]
) -> None:
    """``room_freed_by(owner, cls)`` is what ``num_free_tokens_for(cls)`` gains when ``owner``
    is dropped (BROS's last resort on these blocks), at every state of random workloads."""
    import copy

    host = None if host_blocks is None else host_blocks * block_size
    alloc = BidirectionalAllocator(
        num_blocks * block_size, block_size=block_size, host_capacity_tokens=host
    )
    for op, owner, n in ops:
        cls = CLASSES[owner]
        if op in ("alloc", "make_room") and alloc.can_allocate(owner, n, request_class=cls):
            alloc.allocate(owner, n, request_class=cls)
        elif op == "restore" and alloc.restore_plan(owner) is not None:
            alloc.restore(owner)
        elif op == "free":
            alloc.free(owner, min(n, alloc.logical_len(owner)))
        elif op == "drop":
            alloc.drop(owner)
        for victim in [o for o, c in CLASSES.items() if c == BE and alloc.logical_len(o)]:
            for room_cls in (RT, BE):
                dropped = copy.deepcopy(alloc)
                before = dropped.num_free_tokens_for(room_cls)
                dropped.drop(victim)
                gain = dropped.num_free_tokens_for(room_cls) - before
                assert alloc.room_freed_by(victim, room_cls) == gain, (victim, room_cls)
