"""The event shadow (``worker/sglang/shadow_events.py``) on SGLang 0.5.23's real
``UnifiedRadixCache`` (its Python tree core; the Rust one publishes the same events).

Random inserts and evictions go through the real cache; after each round the shadow's prefix
lengths for a set of requests must equal SGLang's own ``match_kv_cache`` (the exact path the
adapter would use otherwise), and SGLang's publisher must still receive every event, in
order, as if no shadow were there.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang_rig import make_req, publish_server_args
from sglang_rig import unified_cache as rig_unified_cache

from sgl_fair.worker.sglang import shadow_events
from sgl_fair.worker.sglang.shadow_events import EventShadow


def unified_cache(
    kv_tokens: int = 50_000, *, events: bool = True, page_size: int = 1
) -> UnifiedRadixCache:
    publish_server_args()
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(kv_tokens, torch.float16, "cpu", None, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(kv_tokens, page_size, torch.float16, "cpu", None, False)
    return rig_unified_cache(alloc, events=events, page_size=page_size)


def insert(cache: UnifiedRadixCache, ids: list[int]) -> None:
    alloc = cache.token_to_kv_pool_allocator
    ids = ids[: len(ids) // cache.page_size * cache.page_size]  # SGLang caches whole pages
    if not ids:
        return
    key = RadixKey(token_ids=array("q", ids))
    result = cache.insert(InsertParams(key=key, value=alloc.alloc(len(ids))))
    assert result is not None


def test_supported_needs_events():
    assert shadow_events.supported(unified_cache()) is None
    assert "KV events are off" in shadow_events.supported(unified_cache(events=False))


@pytest.mark.parametrize(("seed", "page_size"), [(0, 1), (1, 1), (2, 1), (0, 16), (1, 4)])
def test_prefix_lengths_match_sglangs_and_the_publisher_sees_every_event(seed, page_size):
    """At page size 1 and above (issue 39: a paged server used to match every waiting
    request exactly, each pass, uncapped)."""
    rng = random.Random(seed)
    cache = unified_cache(kv_tokens=2_048, page_size=page_size)
    assert shadow_events.supported(cache) is None
    recorded = []  # every event the cache handed out, in order
    take = cache.take_events

    def spy() -> list:
        out = take()
        recorded.extend(out)
        return out

    cache.take_events = spy
    shadow = EventShadow(cache)
    docs = [[rng.randrange(1000, 30000) for _ in range(rng.randint(20, 200))] for _ in range(6)]
    reqs = []
    for i in range(40):
        doc = rng.choice(docs)
        tail = [rng.randrange(30000, 32000) for _ in range(rng.randint(1, 30))]
        reqs.append(make_req(doc[: rng.randint(5, len(doc))] + tail, "c", rid=f"q{i}"))
    published, checked, hits, misses = [], 0, 0, 0
    for _ in range(15):
        for _ in range(rng.randint(1, 4)):
            doc = rng.choice(docs)
            ids = doc[: rng.randint(3, len(doc))] + [rng.randrange(40000, 41000)]
            if cache.token_to_kv_pool_allocator.available_size() < len(ids):
                cache.evict(EvictParams(num_tokens=len(ids)))
            insert(cache, ids)
        if rng.random() < 0.5:
            cache.evict(EvictParams(num_tokens=rng.randint(1, 300)))
        shadow.begin_pass(reqs)
        assert not shadow.dirty
        memo = shadow.prefix_lens(reqs)  # memo hits in one loop; None: ask prefix_len
        for r, hit in zip(reqs, memo, strict=True):
            got = shadow.prefix_len(r, tuple(r.origin_input_ids))
            match_kv_cache(r, cache, r.origin_input_ids + r.output_ids)  # SGLang's own
            assert got == int(r.prefix_len), r.rid
            assert hit is None or hit == got, r.rid
            checked += got > 0
            hits += hit is not None
            misses += hit is None
        if rng.random() < 0.5:  # SGLang's publisher drains now and then
            published += cache.take_events()
    published += cache.take_events()
    assert published == recorded and any(type(e).__name__ == "BlockRemoved" for e in published)
    assert checked > 0 and shadow.num_rebuilds == 0
    assert hits > 0 and misses > 0  # both paths ran


def test_a_namespaced_request_is_left_to_sglang():
    shadow = EventShadow(unified_cache())
    r = make_req([1, 2, 3], "c")
    assert shadow.handles(r)
    r.extra_key = "tenant-a"
    assert not shadow.handles(r)


@pytest.mark.usefixtures("plugin_hooks")
@pytest.mark.parametrize("policy", ["dlpm", "lpm"])
def test_admission_on_the_unified_cache_matches_the_pure_policy(policy):
    """SGLang's own admission loop over a ``UnifiedRadixCache``: the adapter follows it with
    the event shadow (no ``match_prefix`` per request per pass) and admits in exactly the
    pure policy's order, also above 128 waiting."""
    from test_adapter import POLICIES, reference_order, setup_pair

    big = 1 << 21
    rig, pure, tree, mirrors = setup_pair(
        policy, POLICIES[policy], 300, seed=5, kv_tokens=big, max_prefill_tokens=big,
        chunked_prefill_size=big, cache="unified",
    )  # fmt: skip
    fair = rig.scheduler.policy
    assert isinstance(fair.shadow, EventShadow)
    admitted = rig.admit()
    expected = reference_order(pure, mirrors, tree)
    assert [r.rid for r in admitted] == [m.rid for m in expected]
    assert fair.num_resyncs == 0 and not fair.shadow.dirty and fair.shadow.num_matches > 0


def test_events_of_another_namespace_turn_the_shadow_off():
    """An event naming a LoRA (or a cache salt) would mix another namespace's paths into the
    one tree: the shadow goes dirty for good and the adapter matches exactly."""
    from sglang.srt.disaggregation.kv_events import BlockStored

    shadow = EventShadow(unified_cache())
    stored = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5],
                         block_size=1, lora_id=7)  # fmt: skip
    shadow._take = lambda: [stored]
    shadow.begin_pass([])
    assert shadow.namespaced and shadow.dirty
    shadow._take = lambda: []
    shadow.begin_pass([])
    assert shadow.dirty


def test_a_failure_never_reaches_sglangs_scheduler():
    """Whatever goes wrong while following the events leaves the shadow dirty (the adapter
    then matches exactly) and raises nothing into SGLang's admission pass."""
    cache = unified_cache()
    shadow = EventShadow(cache)

    def broken() -> list:
        raise RuntimeError("boom")

    shadow._take = broken
    shadow.begin_pass([])
    assert shadow.dirty
    shadow._take = lambda: []
    insert(cache, [1, 2, 3])  # its events are lost to the shadow (taken by nobody)
    shadow.begin_pass([])
    assert shadow.dirty  # the shadow misses 3 tokens: it does not pretend otherwise


def test_a_shadow_out_of_step_is_rebuilt_from_the_decoders_pages():
    cache = unified_cache()
    shadow = EventShadow(cache)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 9])
    shadow.begin_pass([])
    shadow.clear()  # the tree loses its paths; the decoder still knows every page
    shadow.begin_pass([])
    assert shadow.num_rebuilds == 1 and not shadow.dirty and shadow.total_tokens == 5
    r = make_req([1, 2, 9, 7], "c")
    assert shadow.prefix_len(r, tuple(r.origin_input_ids)) == 3


def test_the_drain_runs_after_a_batch_result_not_in_the_admission_pass():
    """Issue 39: the KV events a batch result makes are applied in the batch-result hook
    (``after_batch``), off the admission step; the pass that follows applies none. SGLang's
    publisher still receives every event once, in order; a failing drain raises nothing."""
    import types

    from sgl_fair.policies import make_policy
    from sgl_fair.worker.sglang.adapter import FairSchedulePolicy

    cache = unified_cache()
    recorded, take = [], cache.take_events

    def spy() -> list:
        out = take()
        recorded.extend(out)
        return out

    cache.take_events = spy
    fair = FairSchedulePolicy(make_policy("dlpm"), cache)
    shadow = fair.shadow
    assert isinstance(shadow, EventShadow)
    applied: list[int] = []
    sync = shadow.sync
    shadow.sync = lambda: applied.append(sync()) or applied[-1]  # type: ignore[method-assign]
    insert(cache, [5, 6, 7, 8, 9])  # what a batch result caches
    fair.after_batch(types.SimpleNamespace(reqs=[]))
    assert len(applied) == 1 and applied[0] > 0  # its events, drained there
    shadow.begin_pass([])
    assert applied[1:] == [0] and not shadow.dirty  # the pass found nothing left to apply
    req = make_req([5, 6, 7, 8, 9, 1], "c")
    assert shadow.prefix_len(req, tuple(req.origin_input_ids)) == 5
    published = cache.take_events()  # SGLang's publisher: every event, once
    assert published == recorded and len(published) == applied[0]
    assert cache.take_events() == []

    def broken() -> list:
        raise RuntimeError("boom")

    shadow._take = broken
    fair.after_batch(types.SimpleNamespace(reqs=[]))  # raises nothing into SGLang
    assert shadow.dirty


def test_a_rebuild_that_fails_backs_off():
    """A shadow that cannot get in step with SGLang's cache (its counts disagree after a
    rebuild: events this shadow cannot see) matched exactly on every pass — and rebuilt on
    every pass too (34.5 ms at a 15k-token cache, seconds at GPU sizes). Now the rebuilds
    back off: 1, 2, 4, ... passes apart, the shadow dirty (exact matches) between them."""
    cache = unified_cache()
    shadow = EventShadow(cache)
    insert(cache, [1, 2, 3, 4])
    shadow.begin_pass([])
    assert not shadow.dirty and shadow.num_rebuilds == 0
    real = cache.evictable_size
    cache.evictable_size = lambda: real() + 7  # a count the events never explain
    for _ in range(200):
        shadow.begin_pass([])
        assert shadow.dirty
    assert 1 <= shadow.num_rebuilds <= 8  # 1 + 2 + 4 + ... + 128 passes: 8 tries in 200
    cache.evictable_size = real  # in step again: the next try succeeds, the back-off resets
    for _ in range(300):
        shadow.begin_pass([])
    assert not shadow.dirty
