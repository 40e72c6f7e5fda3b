"""KV events of an SGLang cache with EAGLE speculative decoding: its keys are bigrams, and
each stored page lists ``(token, next token)`` pairs (``mem_cache/events.py``). The router
must follow them (before: every batch failed to decode, and the worker's tree stayed empty)."""

from __future__ import annotations

from array import array

import msgspec
import torch
from sglang.srt.disaggregation import kv_events as sgl_kv
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang_rig import publish_server_args

from sgl_fair import kv_events as ours
from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.router.policies import make_router_policy
from sgl_fair.router.router import Router


def eagle_cache():
    publish_server_args()
    alloc = TokenToKVPoolAllocator(50_000, torch.float16, "cpu", None, False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        enable_kv_cache_events=True, is_eagle=True,
    )  # fmt: skip
    return alloc, RadixCache(params)


def test_eagle_bigram_events_rebuild_the_worker_in_our_router():
    alloc, tree = eagle_cache()
    router = Router(make_router_policy("d2lpm"), 2, insert_outputs=False)
    decoder = KVEventDecoder()

    def follow(ts):
        payload = msgspec.msgpack.encode(
            sgl_kv.KVEventBatch(ts=ts, events=tree.take_events())
        )  # what SGLang's publisher sends
        router.apply_kv_ops(1, decoder.apply(ours.decode_batch(payload)), ts)

    doc = list(range(1000, 1064))
    a = doc + list(range(5000, 5032))
    b = doc + list(range(7000, 7048))
    for ids in (a, b):
        tree.insert(
            InsertParams(key=RadixKey(token_ids=array("q", ids)), value=alloc.alloc(len(ids)))
        )
    events = tree.take_events()
    stored = [e for e in events if isinstance(e, sgl_kv.BlockStored)]
    assert stored and isinstance(stored[0].token_ids[0], tuple)  # pairs on the wire
    router.apply_kv_ops(
        1,
        decoder.apply(ours.decode_batch(msgspec.msgpack.encode(
            sgl_kv.KVEventBatch(ts=1.0, events=events)))),
        1.0,
    )  # fmt: skip
    assert decoder.num_malformed == 0 and decoder.num_orphans == 0
    for ids in (a, b):
        key = RadixKey(array("q", ids))
        held = tree.match_prefix(MatchPrefixParams(key=key)).device_prefix_len  # SGLang's
        # the router never claims more than SGLang holds plus the one boundary token
        got = router.tree.match(ids).per_worker[1]
        assert held <= got <= held + 1 and got == len(ids) - 1
    assert router.tree.match(doc + [1]).per_worker == {1: len(doc)}

    tree.evict(EvictParams(num_tokens=30))  # a's tail goes, and SGLang says so
    follow(2.0)
    assert router.tree.match(a).per_worker.get(1, 0) <= len(doc) + 1
    assert router.tree.match(b).per_worker == {1: len(b) - 1}
