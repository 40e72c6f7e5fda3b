"""KV events from SGLang's own radix cache drive our router's global tree (and back).

SGLang's ``RadixCache`` (created with ``enable_kv_cache_events``) records BlockStored /
BlockRemoved / AllBlocksCleared as its tree changes; its publisher sends them as a msgpack
``KVEventBatch``. Here those very events, encoded by SGLang's classes, go through our decoder into
``Router.apply_kv_ops``; the router's view of the worker must then equal SGLang's cache.
"""

from __future__ import annotations

from array import array

import msgspec
import pytest
import torch
from sglang.srt.disaggregation import kv_events as sgl_kv
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang_rig import publish_server_args

from sgl_fair import kv_events as ours
from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.router.policies import make_router_policy
from sgl_fair.router.router import Router


def sglang_cache(page_size: int):
    publish_server_args()
    alloc = TokenToKVPoolAllocator(50_000, torch.float16, "cpu", None, False)
    tree = RadixCache.create_simulated(
        mock_allocator=alloc, page_size=page_size, enable_kv_cache_events=True
    )
    return alloc, tree


def publish(tree, ts: float) -> bytes:
    """What SGLang's ZmqEventPublisher puts in a frame's payload."""
    return msgspec.msgpack.encode(sgl_kv.KVEventBatch(ts=ts, events=tree.take_events()))


@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_cache_events_rebuild_the_worker_in_our_router(page_size):
    alloc, tree = sglang_cache(page_size)
    router = Router(make_router_policy("d2lpm"), 2, insert_outputs=False)
    decoder = KVEventDecoder()

    def follow(ts):
        ops = decoder.apply(ours.decode_batch(publish(tree, ts)))
        router.apply_kv_ops(1, ops, ts)

    doc = list(range(1000, 1000 + 64))
    a = doc + list(range(5000, 5000 + 32))
    b = doc + list(range(7000, 7000 + 48))
    for ids in (a, b):
        tree.insert(
            InsertParams(key=RadixKey(token_ids=array("q", ids)), value=alloc.alloc(len(ids)))
        )
    follow(1.0)
    full = lambda n: n - n % page_size  # only whole pages are published
    assert router.tree.match(a).per_worker == {1: full(len(a))}
    assert router.tree.match(b).per_worker == {1: full(len(b))}
    assert router.tree.match(doc + [1]).per_worker == {1: full(len(doc))}
    assert 0 not in router.tree.match(a).per_worker

    # SGLang evicts a's tail (least recently used leaf first) and says so.
    tree.evict(EvictParams(num_tokens=32))
    follow(2.0)
    assert router.tree.match(a).per_worker.get(1, 0) == full(len(doc))
    assert router.tree.match(b).per_worker == {1: full(len(b))}

    # flush_cache: AllBlocksCleared forgets the worker.
    tree.reset()
    follow(3.0)
    assert router.tree.match(b).per_worker == {}


def test_our_events_decode_with_sglangs_classes():
    enc = ours.KVEventEncoder(page_size=4)
    events = enc.events([("stored", tuple(range(12)), 0)])
    events += enc.events([("removed", tuple(range(12)), 8)])
    payload = ours.encode_batch(ours.KVEventBatch(ts=1.0, events=events))
    theirs = msgspec.msgpack.Decoder(sgl_kv.KVEventBatch).decode(payload)
    stored, removed = theirs.events
    assert isinstance(stored, sgl_kv.BlockStored) and stored.token_ids == list(range(12))
    assert stored.block_size == 4 and len(stored.block_hashes) == 3
    assert isinstance(removed, sgl_kv.BlockRemoved)
    assert removed.block_hashes == stored.block_hashes[2:]
