"""The Router core: dispatch bookkeeping, every worker message, membership, and a state
machine over random interleavings of all of them (every policy) against the naive model."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from router_helpers import finished, make_req, model_evict, nonempty, prefixes, tree_holdings

from sgl_fair.messages import Evicted, FinishReason, Load, Tokens
from sgl_fair.router import GlobalMatch, Router, make_router_policy, router_policy_names

PROMPT = (1, 2, 3, 4)


def router(policy: str = "least-load", num_workers: int = 2, **kw) -> Router:
    return Router(make_router_policy(policy), num_workers, **kw)


# ---- dispatch --------------------------------------------------------------------------------


def test_dispatch_records_the_request_everywhere():
    r = router(num_workers=3)
    req = make_req(PROMPT, "alice")
    d = r.dispatch(req, 1.5)
    assert (d.worker, d.req, d.sent_s) == (0, req, 1.5)
    assert r.now == 1.5
    assert r.inflight == {req.rid: (0, "alice")}
    assert [r.queue_len(u) for u in r.workers] == [1, 0, 0]
    assert r.tree.match(PROMPT) == GlobalMatch(4, frozenset({0}), {0: 4})
    assert r.stats[0].num_dispatched == 1
    r.check_invariants()


def test_each_dispatch_carries_the_clients_calls_in_flight_over_the_cluster():
    """A worker sees only its share of a client's calls; the router counts them all and
    sends the count with each (``Request.cluster_inflight``, for the share guard)."""
    r = router(num_workers=2)
    a = [make_req((1, 2, i), "a") for i in range(3)]
    sent = [r.dispatch(q, 0.0) for q in a]
    assert [d.req.cluster_inflight for d in sent] == [1, 2, 3]
    assert {d.worker for d in sent} == {0, 1}  # over both workers
    assert r.dispatch(make_req((9,), "b"), 0.0).req.cluster_inflight == 1
    r.handle(finished(sent[0].worker, a[0], (5,)), 1.0)
    assert r.dispatch(make_req((1, 2, 9), "a"), 1.0).req.cluster_inflight == 3
    r.remove_worker(1)  # its calls are no longer in flight (they come back as new dispatches)
    left = [c for u, c in r.inflight.values()]
    assert sorted(left) == sorted(c for c, n in r.client_inflight.items() for _ in range(n))
    assert sum(r.client_inflight.values()) == len(r.inflight) < 5
    r.check_invariants()
    r.client_inflight["a"] = 99
    with pytest.raises(AssertionError, match="client_inflight"):
        r.check_invariants()


def test_dispatch_without_workers_or_twice_raises():
    r = router(num_workers=1)
    req = make_req(PROMPT)
    r.dispatch(req, 0.0)
    with pytest.raises(ValueError, match=req.rid):
        r.dispatch(req, 0.0)
    r.remove_worker(0)
    with pytest.raises(RuntimeError, match="no worker alive"):
        r.dispatch(make_req(PROMPT), 0.0)


def test_router_rejects_bad_construction():
    with pytest.raises(ValueError):
        router(num_workers=0)
    with pytest.raises(ValueError):
        router(max_tree_tokens=-1)


# ---- Finished --------------------------------------------------------------------------------


def test_finished_frees_the_queue_and_records_the_output_on_the_worker():
    r = router()
    req = make_req(PROMPT)
    u = r.dispatch(req, 0.0).worker
    r.handle(finished(u, req, (8, 9), t_s=1.0), 1.1)
    assert r.inflight == {} and r.queue_len(u) == 0
    assert r.tree.match((*PROMPT, 8, 9, 7)).per_worker == {u: 6}  # a follow-up call hits
    assert (r.stats[u].num_finished, r.stats[u].num_failed) == (1, 0)
    r.check_invariants()


@pytest.mark.parametrize("reason", [FinishReason.REJECTED, FinishReason.ABORTED])
def test_failed_requests_free_the_queue_but_add_no_output(reason):
    r = router()
    req = make_req(PROMPT)
    r.dispatch(req, 0.0)
    r.handle(finished(0, req, (8,), reason=reason), 0.0)
    assert r.queue_len(0) == 0 and r.stats[0].num_failed == 1
    assert r.tree.match((*PROMPT, 8)).length == 4


def test_insert_outputs_false_keeps_outputs_out_of_the_tree():
    r = router(insert_outputs=False)
    req = make_req(PROMPT)
    r.dispatch(req, 0.0)
    r.handle(finished(0, req, (8, 9)), 0.0)
    assert r.tree.match((*PROMPT, 8, 9)).length == 4


def test_stale_finished_messages_are_counted_and_ignored():
    r = router()
    req = make_req(PROMPT)
    r.dispatch(req, 0.0)
    r.handle(finished(1, req, (8,)), 0.0)  # from the wrong worker
    r.handle(finished(0, make_req((5,)), (8,)), 0.0)  # never dispatched
    r.handle(finished(7, req, (8,)), 0.0)  # a worker id never seen
    assert r.inflight and r.queue_len(0) == 1
    assert (r.stats[1].num_stale, r.stats[0].num_stale, r.stats[7].num_stale) == (1, 1, 1)
    assert r.tree.match((*PROMPT, 8)).length == 4
    r.check_invariants()


# ---- Evicted ---------------------------------------------------------------------------------


def test_an_eviction_report_ends_locality_for_that_prefix():
    """Before the report, the holder wins despite its longer queue; after it, load decides."""
    r = router("d2lpm")
    family = tuple(range(100, 120))
    r.dispatch(make_req(family + (1,)), 0.0)  # worker 0 (ties: lowest id)
    for i in range(3):
        r.dispatch(make_req(family + (10 + i,)), 0.0)
    assert r.queue_len(0) == 4 and r.queue_len(1) == 0  # all followed the prefix
    r.handle(Evicted(0, 1.0, ((family + (1,), 0),)), 1.0)
    m = r.tree.match(family)
    assert 0 not in m.holders and 0 not in m.per_worker
    assert r.dispatch(make_req(family + (99,)), 2.0).worker == 1
    assert r.stats[0].num_evicted_blocks == 1 and r.stats[0].num_evicted_tokens > 0
    r.check_invariants()


def test_eviction_of_a_suffix_keeps_the_prefix_and_a_redispatch_restores_it():
    r = router()
    r.dispatch(make_req(PROMPT), 0.0)
    r.handle(Evicted(0, 1.0, ((PROMPT, 2),)), 1.0)
    assert r.tree.match(PROMPT).per_worker == {0: 2}
    r.dispatch(make_req(PROMPT), 2.0)  # least-load: worker 1
    r.dispatch(make_req(PROMPT), 2.0)  # worker 0 again: it holds all 4 tokens again
    assert r.tree.match(PROMPT).per_worker == {0: 4, 1: 4}


def test_eviction_reports_never_fail():
    r = router()
    r.dispatch(make_req(PROMPT), 0.0)
    blocks = (((), 0), ((9, 9, 9), 1), ((*PROMPT, 5, 6), 5), (PROMPT, 10), (PROMPT[:2], 0))
    r.handle(Evicted(1, 1.0, blocks), 1.0)  # worker 1 holds none of it
    assert r.tree.match(PROMPT).per_worker == {0: 4}
    r.handle(Evicted(0, 1.0, blocks), 1.0)  # the last block drops everything of worker 0
    assert r.tree.total_tokens == 0
    r.remove_worker(1)
    r.handle(Evicted(1, 2.0, blocks), 2.0)  # from a dead worker
    assert r.stats[1].num_stale == 1
    r.check_invariants()


def test_a_finished_stamped_before_the_latest_eviction_report_is_not_reinserted():
    r = router()
    req = make_req(PROMPT)
    r.dispatch(req, 0.0)
    r.handle(Evicted(0, 5.0, ((PROMPT, 0),)), 5.0)
    r.handle(finished(0, req, (8,), t_s=4.0), 6.0)  # sent before the eviction, delivered after
    assert r.tree.total_tokens == 0 and r.queue_len(0) == 0


# ---- Load, Tokens, bad messages ---------------------------------------------------------------


def test_load_keeps_the_latest_report_per_worker():
    r = router()
    assert r.load(0) is None
    newer, older = Load(0, 2.0, 3, 1, 10, 20, 100), Load(0, 1.0, 9, 9, 9, 9, 100)
    r.handle(newer, 2.0)
    r.handle(older, 2.5)  # delivered late
    assert r.load(0) is newer and r.load(1) is None


def test_tokens_are_counted_per_worker():
    r = router()
    r.handle(Tokens(1, 0.0, (("a", (1, 2)), ("b", (3,)))), 0.0)
    assert r.stats[1].num_output_tokens == 3


def test_unknown_messages_raise():
    with pytest.raises(TypeError):
        router().handle("hello", 0.0)  # type: ignore[arg-type]


# ---- membership ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", router_policy_names())
def test_a_dead_worker_is_never_selected_and_its_requests_come_back(policy):
    r = router(policy, num_workers=3)
    reqs = [make_req((i % 2, 7, 7, i), f"c{i % 2}") for i in range(9)]
    sent = {req.rid: r.dispatch(req, 0.0).worker for req in reqs}
    lost = r.remove_worker(1)
    assert sorted(lost) == sorted(rid for rid, u in sent.items() if u == 1)
    assert 1 not in r.tree.workers() and r.workers == (0, 2)
    for i in range(20):
        assert r.dispatch(make_req((i % 2, 7, 7, 100 + i)), float(i)).worker != 1
    for rid in lost:  # their Finished arrives late: ignored
        req = next(q for q in reqs if q.rid == rid)
        r.handle(finished(1, req, (5,)), 30.0)
    assert r.stats[1].num_stale == len(lost)
    assert r.remove_worker(1) == []
    r.add_worker(1)
    assert r.workers == (0, 1, 2) and r.queue_len(1) == 0
    r.check_invariants()


def test_add_worker_grows_the_cluster():
    r = router(num_workers=1)
    r.add_worker(3)
    r.add_worker(3)
    assert r.workers == (0, 3)
    assert [r.dispatch(make_req(PROMPT), 0.0).worker for _ in range(2)] == [0, 3]
    with pytest.raises(ValueError):
        r.add_worker(-1)
    r.check_invariants()


def test_max_tree_tokens_bounds_the_tree():
    r = router(max_tree_tokens=10)
    for i in range(10):
        r.dispatch(make_req((i, i, i, i)), float(i))
        r.check_invariants()
        assert r.tree.total_tokens <= 10
    assert r.tree.match((9, 9, 9, 9)).length == 4  # the most recent survive


def test_check_invariants_catches_drift():
    r = router()
    r.dispatch(make_req(PROMPT), 0.0)
    r._queue_len[1] += 1
    with pytest.raises(AssertionError, match="queue_len"):
        r.check_invariants()
    r._queue_len[1] -= 1
    r.tree.insert((5,), 9)  # a worker the router does not know
    with pytest.raises(AssertionError, match="dead workers"):
        r.check_invariants()


# ---- state machine ---------------------------------------------------------------------------

WORKER_IDS = (0, 1, 2)
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)


class RouterMachine(RuleBasedStateMachine):
    """Random interleavings of dispatch / Finished / Evicted / remove / add, any policy,
    with and without a tree bound; the tree must always equal the model."""

    @initialize(
        policy=st.sampled_from(router_policy_names()),
        quantum=st.sampled_from((3.0, 10_000.0, math.inf)),
        max_tree_tokens=st.sampled_from((None, 12)),
        insert_outputs=st.booleans(),
    )
    def setup(self, policy, quantum, max_tree_tokens, insert_outputs):
        options = {"quantum": quantum} if policy == "d2lpm" else {}
        self.router = Router(
            make_router_policy(policy, **options),
            len(WORKER_IDS),
            insert_outputs=insert_outputs,
            max_tree_tokens=max_tree_tokens,
        )
        self.held = {u: {()} for u in WORKER_IDS}
        self.alive = set(WORKER_IDS)
        self.inflight = {}  # rid -> (worker, request)
        self.gone = []  # requests finished or lost: their messages are stale now
        self.evicted_s = {}
        self.seen = [()]
        self.now = 0.0

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def _sync_trim(self) -> None:
        """After a tree bound kicked in, the tree may only have forgotten (never invented)."""
        total = len(set().union(*self.held.values())) - 1
        limit = self.router.max_tree_tokens
        if limit is not None and total > limit:
            after = tree_holdings(self.router.tree)
            for u in WORKER_IDS:
                assert after.get(u, {()}) <= self.held[u]
                self.held[u] = after.get(u, {()})

    @precondition(lambda self: self.alive)
    @rule(tokens=TOKENS, client=st.sampled_from(("a", "b")))
    def dispatch(self, tokens, client):
        req = make_req(tokens, client)
        worker = self.router.dispatch(req, self._tick()).worker
        assert worker in self.alive
        self.held[worker] |= prefixes(tokens)
        self.inflight[req.rid] = (worker, req)
        self.seen.append(tokens)
        self._sync_trim()

    @precondition(lambda self: self.inflight or self.gone)
    @rule(data=st.data(), ok=st.booleans(), output=TOKENS, late=st.booleans())
    def finish(self, data, ok, output, late):
        rid = data.draw(st.sampled_from(sorted(self.inflight) + [r.rid for _, r in self.gone]))
        if rid in self.inflight:
            worker, req = self.inflight.pop(rid)
        else:
            worker, req = next((u, r) for u, r in self.gone if r.rid == rid)
        now = self._tick()
        t_s = self.evicted_s[worker] - 0.5 if late and worker in self.evicted_s else now
        reason = FinishReason.LENGTH if ok else FinishReason.ABORTED
        stale_before = self.router.stats[worker].num_stale
        self.router.handle(finished(worker, req, output, t_s=t_s, reason=reason), now)
        if (worker, req) in self.gone:
            assert self.router.stats[worker].num_stale == stale_before + 1
            return
        self.gone.append((worker, req))
        if ok and self.router.insert_outputs and t_s >= self.evicted_s.get(worker, -1.0):
            self.held[worker] |= prefixes(req.input_ids + output)
            self.seen.append(req.input_ids + output)
            self._sync_trim()

    @rule(data=st.data(), worker=st.sampled_from(WORKER_IDS), start=st.integers(0, 9))
    def evict(self, data, worker, start):
        path = data.draw(st.one_of(st.sampled_from(self.seen), TOKENS))
        now = self._tick()
        self.router.handle(Evicted(worker, now, ((path, start),)), now)
        if worker in self.alive:
            model_evict(self.held, worker, path, start)
            self.evicted_s[worker] = now
        # Once handled, nothing of path[start:] is credited to the worker.
        assert self.router.tree.match(path, touch=False).per_worker.get(worker, 0) <= start

    @rule(worker=st.sampled_from(WORKER_IDS))
    def remove_worker(self, worker):
        lost = self.router.remove_worker(worker)
        expected = sorted(rid for rid, (u, _) in self.inflight.items() if u == worker)
        assert sorted(lost) == (expected if worker in self.alive else [])
        for rid in expected:
            self.gone.append(self.inflight.pop(rid))
        self.alive.discard(worker)
        self.held[worker] = {()}
        self.evicted_s.pop(worker, None)

    @rule(worker=st.sampled_from(WORKER_IDS))
    def add_worker(self, worker):
        self.router.add_worker(worker)
        self.alive.add(worker)

    @invariant()
    def agrees_with_model(self):
        r = self.router
        r.check_invariants()
        assert r.workers == tuple(sorted(self.alive))
        assert tree_holdings(r.tree) == nonempty(self.held)
        assert {rid: u for rid, (u, _) in r.inflight.items()} == {
            rid: u for rid, (u, _) in self.inflight.items()
        }


RouterMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None, derandomize=True
)
TestRouterMachine = RouterMachine.TestCase
