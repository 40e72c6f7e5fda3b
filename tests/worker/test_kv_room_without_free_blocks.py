"""Found by ``bros-bicache`` (issue 33): on block allocators, ``PrefixKVCache`` refuses a token
that fits in the owner's own last block whenever no whole block is free — its cheap gate
(``num_tokens > available_tokens()``) counts free blocks and evictable tokens, not the
owner's room. In a step where one decode takes the last free block, every later decode
with room of its own was refused (``allocate_each``), and the scheduler retracted a request
for it. Fixed: the allocator is asked before the gate, and a token that fits in the
owner's room evicts nothing."""

from __future__ import annotations

from sgl_fair.worker.kv import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator


def _owner_with_room_and_no_free_block():
    alloc = make_allocator("paged", 8, block_size=4)
    kv = PrefixKVCache(alloc)
    kv.allocate("a", 5)  # both blocks: 4 + 1 tokens, 3 slots of room in the second
    assert not alloc.layout.free_blocks and alloc.room("a") == 3
    assert alloc.can_allocate("a", 1)  # the allocator itself says yes
    return kv


def test_a_token_in_the_owners_own_block_is_allowed():
    assert _owner_with_room_and_no_free_block().can_allocate("a", 1)


def test_a_decode_step_grows_into_its_own_block():
    assert _owner_with_room_and_no_free_block().allocate_each(["a"]) == 1
