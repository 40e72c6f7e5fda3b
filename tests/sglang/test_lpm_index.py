"""The LPM order kept across passes (``worker/sglang/lpm_index.py``) admits exactly as the
order read from scratch on every pass, inside SGLang's real admission code.

Two rigs (``sglang_rig.py``: SGLang's real ``Req``, cache and ``_get_new_batch_prefill_raw``)
run in lockstep through the same random steps — arrivals (some under a rid already live),
prefixes cached and evicted between passes, admission passes, batch results that finish or
abort, aborts in the queue, retractions — one with the index, one without (the pass before
it: ``lpm_order`` over the whole queue each time). Every pass must admit the same requests in
the same order, and the index must have answered most passes without re-reading the queue.
"""

from __future__ import annotations

import random

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_rig import make_req
from test_plugin_property import Run as PropertyRun

from sgl_fair.worker.sglang import plugin

pytestmark = pytest.mark.usefixtures("plugin_hooks")


def _queue(scheduler, req, *args, **kwargs):
    scheduler.waiting_queue.append(req)


class Run(PropertyRun):
    """The plugin property's run (batch results, aborts, retractions), with prompts that
    share prefixes of three documents, and prefixes cached and evicted between passes."""

    def __init__(self, policy: str, cache: str, seed: int, index: bool) -> None:
        super().__init__(policy, random.Random(seed), cache)
        self.namespaced = seed % 3 == 2  # some arrivals with an extra_key
        docs = random.Random(seed + 1)
        self.docs = [[docs.randrange(5, 400) for _ in range(60)] for _ in range(3)]
        assert self.fair.lpm_index is not None
        if not index:  # the pass before the index: lpm_order over the whole queue each time
            self.fair.lpm_index = None
            self.fair.ledger.waiting.untrack()

    def tokens(self) -> list[int]:
        rng = self.rng
        head = rng.choice(self.docs)[: rng.randrange(0, 61)]
        return head + [rng.randrange(400, 500) for _ in range(rng.randrange(1, 12))]

    def arrive(self) -> None:
        self.n += 1
        rng = self.rng
        rid = f"r{rng.randrange(self.n)}" if rng.random() < 0.15 else f"r{self.n}"
        req = make_req(self.tokens(), rng.choice("abc"), max_new_tokens=4, rid=rid)
        if self.namespaced and rng.random() < 0.05:  # its own tree (RadixCache's shadow), or
            req.extra_key = "ns"  # matched by SGLang (the event shadow does not follow it)
        plugin._around_add_request(_queue, self.s, req)

    def cache(self) -> None:
        self.rig.cache(self.tokens())

    def evict(self) -> None:
        self.rig.tree.evict(EvictParams(num_tokens=self.rng.randrange(1, 80)))

    def admit(self) -> list[str]:
        admitted = self.rig.admit()
        self.running += admitted
        return [r.rid for r in admitted]


def check_each_sync(fair) -> None:
    """After each sync that answers, every kept length is the shadow's match from scratch."""
    index, shadow, req_of = fair.lpm_index, fair.shadow, fair.ledger.req_of
    sync = index.sync

    def checked(*args):
        ok = sync(*args)
        if ok:
            for key, n in index.lengths().items():
                req = req_of(index._member[key])
                tokens = tuple(req.origin_input_ids) + tuple(req.output_ids)
                tree = shadow._tree((req.extra_key, req.cache_salt or None))
                assert n == tree.match(shadow._units(tokens), touch=False).length * shadow.page
        return ok

    index.sync = checked


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cache", ["radix", "unified"])
@pytest.mark.parametrize("policy", ["dlpm", "lpm"])
def test_the_kept_order_admits_as_the_order_read_each_pass(policy, cache, seed):
    rng = random.Random(seed)
    steps = rng.choices("aceAsxr", weights=[10, 3, 2, 2, 2, 1, 1], k=300)
    kept, fresh = Run(policy, cache, seed, True), Run(policy, cache, seed, False)
    check_each_sync(kept.fair)
    try:
        for op in steps:
            if op == "A":
                assert kept.admit() == fresh.admit()
                continue
            for run in (kept, fresh):
                {"a": run.arrive, "c": run.cache, "e": run.evict, "s": run.step,
                 "x": run.abort_queued, "r": run.retract}[op]()  # fmt: skip
        assert kept.fair.errors.counts == {} == fresh.fair.errors.counts
        assert not kept.fair.shadow.dirty
        index = kept.fair.lpm_index
        if not (kept.namespaced and cache == "unified"):  # (there: off while one waits)
            assert index.num_kept >= 10, (index.num_kept, index.num_full)  # it answered
    finally:
        kept.fair.detach()
        fresh.fair.detach()


@pytest.mark.parametrize("cache", ["radix", "unified"])
def test_a_pass_reads_only_what_changed(cache):
    """After the first pass, a pass re-reads the new arrival and the requests whose matches
    a new cached prefix touched, not the whole queue."""
    run = Run("dlpm", cache, 3, True)
    try:
        for _ in range(200):
            run.arrive()
        run.admit()
        index = run.fair.lpm_index
        assert index.num_full == 1 and index.num_read == 200
        run.arrive()
        run.cache()
        run.admit()
        assert index.num_full == 1
        assert 1 <= index.num_read < 60
    finally:
        run.fair.detach()


@pytest.mark.parametrize("cache", ["radix", "unified"])
def test_a_prefix_evicted_under_a_waiting_request_is_seen(cache):
    """A request whose match ends where a cached prefix ends: evicting that prefix shortens
    it, though no edge changes at the node it would go on from (the node itself leaves)."""
    run = Run("lpm", cache, 4, True)
    check_each_sync(run.fair)  # every length kept, checked at each pass
    index = run.fair.lpm_index
    try:
        doc = run.docs[0]
        run.rig.cache(doc)
        reqs = [make_req(doc + [450], "a"), make_req(doc[:30] + [460], "b")]
        for req in reqs:
            plugin._around_add_request(_queue, run.s, req)
        run.fair.calc_priority(run.s.waiting_queue)  # a pass that admits nothing
        assert sorted(index.lengths().values()) == [30, 60]
        run.rig.tree.evict(EvictParams(num_tokens=10_000))  # the doc leaves the cache
        run.fair.calc_priority(run.s.waiting_queue)
        assert sorted(index.lengths().values()) == [0, 0]
        assert index.num_full == 1 and index.num_kept == 1
    finally:
        run.fair.detach()


def test_a_request_the_shadow_does_not_match_turns_the_index_off_until_it_leaves():
    """The event shadow leaves a namespaced request to SGLang's own match: while it waits the
    index does not answer, without re-reading the queue on every pass; once it leaves the
    index reads the queue again, once."""
    run = Run("dlpm", "unified", 6, True)
    index = run.fair.lpm_index
    try:
        for _ in range(50):
            run.arrive()
        stranger = make_req(run.tokens(), "a", rid="ns")
        stranger.extra_key = "tenant-ns"
        plugin._around_add_request(_queue, run.s, stranger)
        for _ in range(3):
            run.fair.calc_priority(run.s.waiting_queue)  # passes that admit nothing
        assert index.num_full == 1 and index.num_kept == 0
        run.s.waiting_queue.remove(stranger)
        plugin._after_abort(None, run.s)
        run.fair.calc_priority(run.s.waiting_queue)
        run.fair.calc_priority(run.s.waiting_queue)
        assert index.num_full == 2 and index.num_kept == 1
        assert run.fair.errors.counts == {}
    finally:
        run.fair.detach()


def test_a_sync_that_fails_halfway_reads_everything_at_the_next_pass():
    """An error inside the index (here: a match that raises) falls back to SGLang's order for
    that pass (the hook's guard), and the next pass re-reads the queue, never a half-kept one."""
    run = Run("dlpm", "radix", 7, True)
    check_each_sync(run.fair)
    index, shadow = run.fair.lpm_index, run.fair.shadow
    try:
        for _ in range(30):
            run.arrive()
        run.fair.calc_priority(run.s.waiting_queue)
        run.arrive()
        real = shadow.prefix_len
        shadow.prefix_len = lambda *a: 1 / 0
        run.fair.calc_priority(run.s.waiting_queue)
        assert run.fair.errors.counts == {"calc_priority": 1}
        shadow.prefix_len = real
        run.fair.calc_priority(run.s.waiting_queue)
        assert index.num_full == 2 and run.fair.errors.counts == {"calc_priority": 1}
    finally:
        run.fair.detach()
