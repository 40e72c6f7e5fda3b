"""The adapter's shadow cache (``worker/sglang/shadow.py``): same prefix lengths, same order.

Two rigs with SGLang 0.5.23's real ``Req``, ``RadixCache`` and admission loop hold the same
cache and queue; one plugin matches prefixes through the shadow (memoised), the other through
SGLang's ``match_prefix`` per request per pass (the exact path it replaces). Between passes
both caches get the same inserts (finished requests' KV, a branch in the middle of a waiting
request's path) and evictions (through ``RadixCache.evict``), so a stale memo would show up
as a different admission order.
"""

from __future__ import annotations

import itertools
import random
from array import array
from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang_rig import Rig, make_req

from sgl_fair.worker.sglang import plugin
from sgl_fair.worker.sglang.settings import PluginSettings
from sgl_fair.worker.sglang.shadow import OWNER, ShadowCache

BIG = 1 << 30


pytestmark = pytest.mark.usefixtures("plugin_hooks")  # conftest.py


def workload(seed: int, n: int):
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 30000) for _ in range(rng.randint(30, 400))] for _ in range(8)]
    clients = ("a", "b", "c", "flood", "flood", "flood")

    def one():
        doc = rng.choice(docs)
        tail = [rng.randrange(30000, 32000) for _ in range(rng.randint(5, 80))]
        return rng.choice(clients), doc[: rng.randint(10, len(doc))] + tail

    return rng, docs, [one() for _ in range(n)], one


class Pair:
    """The same state twice: ``fast`` matches through the shadow, ``exact`` through SGLang."""

    def __init__(self, policy: str, opts: dict, seed: int, n: int) -> None:
        self.rng, docs, reqs, self.one = workload(seed, n)
        self.rigs = []
        for exact in (False, True):
            rig = Rig(kv_tokens=BIG >> 8, max_prefill_tokens=3000, chunked_prefill_size=3000)
            fair = plugin.install_policy(rig.scheduler, PluginSettings(policy, opts))
            fair.ledger.clock = itertools.count().__next__  # same arrival times on both sides
            if exact:  # the oracle: SGLang's own match for every request, unbounded
                fair.disable_shadow()
                fair.exact_cap = None
            for doc in docs[:5]:  # 3 documents are not cached: their requests share uncached
                rig.cache(doc)
            self.rigs.append(rig)
        self.queued: list[list] = [[], []]
        for client, ids in reqs:
            self.arrive(client, ids)

    @property
    def fast(self):
        return self.rigs[0].scheduler.policy

    def arrive(self, client: str, ids: list[int]) -> None:
        for rig, queued in zip(self.rigs, self.queued, strict=True):
            req = make_req(ids, client)
            queued.append(req)
            rig.queue(req)

    def admit(self) -> list[int]:
        orders = []
        for rig, queued in zip(self.rigs, self.queued, strict=True):
            pos = {id(r): i for i, r in enumerate(queued)}
            orders.append([pos[id(r)] for r in rig.admit()])
        assert orders[0] == orders[1]
        return orders[0]

    def cache(self, ids: list[int]) -> None:
        for rig in self.rigs:
            rig.cache(ids)

    def evict_all_but(self, keep: list[list[int]]) -> None:
        """Real ``RadixCache.evict`` until only ``keep`` (and what running requests lock) is
        left: the same result on both sides, whatever nodes SGLang's matches have split."""
        for rig in self.rigs:
            tree = rig.tree
            locks = [
                tree.lock(tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", k))))
                          .last_device_node)
                for k in keep
            ]  # fmt: skip
            tree.evict(EvictParams(num_tokens=BIG))
            for lock in locks:
                tree.unlock(lock)

    def sizes(self) -> list[int]:
        return [rig.tree.total_size() for rig in self.rigs]


@pytest.mark.parametrize(("policy", "opts"), [("dlpm", {"quantum": 300}), ("lpm", {})])
@pytest.mark.parametrize("seed", [1, 2])
def test_shadow_order_equals_exact_order_across_inserts_and_evictions(policy, opts, seed):
    pair = Pair(policy, opts, seed, 400)
    admitted = pair.admit()
    assert len(admitted) > 5
    for step in range(6):
        rng = pair.rng
        waiting = pair.queued[0]
        left = [r for r in pair.rigs[0].scheduler.waiting_queue]
        # Inserts: finished requests leave their KV; a branch lands mid-path of waiting ones.
        for i in admitted[:4]:
            pair.cache(list(waiting[i].origin_input_ids) + [5] * rng.randint(1, 20))
        for r in rng.sample(left, min(5, len(left))):
            ids = list(r.origin_input_ids)
            pair.cache(ids[: rng.randint(1, len(ids))] + [rng.randrange(32000, 33000)] * 3)
        if step % 2 == 1:  # evictions: keep a few prefixes, SGLang evicts the rest
            keep = [list(r.origin_input_ids)[:40] for r in rng.sample(left, min(6, len(left)))]
            pair.evict_all_but(keep)
        for _ in range(rng.randint(0, 20)):
            pair.arrive(*pair.one())
        sizes = pair.sizes()
        assert sizes[0] == sizes[1]
        admitted = pair.admit()
    assert pair.fast.shadow is not None and pair.fast.shadow.num_rebuilds == 0
    assert pair.rigs[1].scheduler.policy.shadow is None


def test_a_pass_rematches_only_the_requests_whose_match_changed():
    pair = Pair("dlpm", {"quantum": 300}, 3, 800)
    pair.admit()
    fair = pair.fast
    shadow, tree = fair.shadow, pair.rigs[0].tree
    before = shadow.num_matches
    pair.admit()
    assert shadow.num_matches == before  # nothing changed: every match memoised
    counts = []
    for k in range(6):
        left = list(pair.rigs[0].scheduler.waiting_queue)
        old = {r.rid: exact_len(tree, r) for r in left}
        # a waiting request's whole prompt gets cached: it and the requests sharing more of
        # it than was cached before match more; nobody else's match may be redone
        pair.cache(list(left[(k * 37) % len(left)].origin_input_ids) + [1])
        # memos of matches that end inside an edge are keyed on its parent's version (the
        # first match of each request); a re-match keys them exactly (ShadowCache._match)
        keyed = sum(shadow._memo[r.rid].version is not None for r in left)
        before = shadow.num_matches
        new = {r.rid: shadow.prefix_len(r, fair.ledger.mirrors[r.rid].input_ids) for r in left}
        assert new == {r.rid: exact_len(tree, r) for r in left}
        changed = sum(new[rid] != old[rid] for rid in new)
        rematched = shadow.num_matches - before
        assert 1 <= changed <= rematched <= changed + keyed
        counts.append((rematched, changed))
        pair.admit()
    # after the first change has re-keyed the memos it touched, exactly the changed ones
    assert all(r == c for r, c in counts[1:]), counts


def exact_len(tree, req) -> int:
    match_kv_cache(req, tree, req.origin_input_ids + req.output_ids)
    return int(req.prefix_len)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shadow_lengths_equal_match_prefix_under_lru_eviction_and_reset(page_size):
    """Every length the shadow gives equals SGLang's, after inserts, partial LRU evictions
    (SGLang picks the victims), a reset, with key namespaces and output tokens."""
    rng, docs, reqs, _ = workload(7, 200)
    freed = SimpleNamespace(free_segment=lambda *a, **k: None, device="cpu")
    tree = RadixCache.create_simulated(mock_allocator=freed, page_size=page_size)
    shadow = ShadowCache(tree)
    queue = []
    for i, (_client, ids) in enumerate(reqs):
        req = make_req(ids, "a")
        if i % 10 == 0:
            req.extra_key = "lora-1"  # its own namespace in SGLang's cache
        if i % 7 == 0:
            req.output_ids.extend(rng.randrange(40000, 41000) for _ in range(5))
        queue.append(req)

    def insert(ids, extra_key=None):
        n = len(ids) // page_size * page_size
        tree.insert(InsertParams(key=RadixKey(array("q", ids[:n]), extra_key)))

    def check():
        assert shadow.in_sync()
        for req in queue:
            assert shadow.prefix_len(req, tuple(req.origin_input_ids)) == exact_len(tree, req)

    for doc in docs[:5]:
        insert(doc)
    insert(docs[0], "lora-1")
    check()
    for _ in range(8):
        for req in rng.sample(queue, 10):
            ids = list(req.origin_input_ids) + list(req.output_ids)
            insert(ids[: rng.randint(1, len(ids))] + [rng.randrange(33000, 34000)] * 9,
                   req.extra_key)  # fmt: skip
        check()
        tree.evict(EvictParams(num_tokens=rng.randint(50, 1500)))
        check()
    tree.reset()
    assert shadow.total_tokens == 0
    check()
    insert(docs[1])
    check()
    assert shadow.num_rebuilds == 0
    shadow.detach()
    assert "record_store" not in tree.kv_events.__dict__


def test_a_shadow_out_of_step_is_rebuilt_before_the_pass():
    pair = Pair("dlpm", {"quantum": 300}, 4, 200)
    pair.admit()
    shadow = pair.fast.shadow
    # A change SGLang never reported (a path we did not foresee): the count check sees it.
    next(iter(shadow.trees.values())).insert((99, 98, 97), owner=OWNER)
    assert not shadow.in_sync()
    pair.admit()  # still the exact order (Pair.admit asserts it)
    assert shadow.num_rebuilds == 1 and shadow.in_sync()


def test_caches_the_shadow_cannot_follow_keep_the_exact_path():
    rig = Rig()
    rig.tree.is_eagle = True  # bigram keys: not shadowed
    fair = plugin.install_policy(rig.scheduler, PluginSettings("dlpm", {}))
    assert fair.shadow is None
    rig.tree.is_eagle = False
    rig.cache([1, 2, 3, 4])
    rig.queue(make_req([1, 2, 3, 9], "a"))
    assert [r.origin_input_ids.tolist() for r in rig.admit()] == [[1, 2, 3, 9]]


def test_without_a_shadow_a_pass_matches_at_most_128_requests_exactly():
    """Where the shadow cannot answer, the plugin matched every waiting request on SGLang's
    own tree on every pass, uncapped (SGLang's LPM matches none beyond 128 waiting), and each
    match moves SGLang's LRU clock. Now a pass matches at most 128; the rest keep the length
    of their last match."""
    from sglang.srt.mem_cache import common

    pair = Pair("dlpm", {}, seed=3, n=400)
    exact = pair.rigs[1].scheduler.policy
    exact.exact_cap = 128  # the default, set back on the oracle side
    calls = [0]
    real = common.match_kv_cache

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    import sgl_fair.worker.sglang.adapter as adapter_mod

    orig = adapter_mod.match_kv_cache
    adapter_mod.match_kv_cache = counting
    try:
        exact.calc_priority(pair.rigs[1].scheduler.waiting_queue, None)
        exact.close_walk()
    finally:
        adapter_mod.match_kv_cache = orig
    assert calls[0] == 128 and exact.num_capped > 0
