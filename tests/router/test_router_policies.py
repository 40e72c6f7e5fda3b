"""Each baseline router policy's defining rule in a small deterministic scenario, and the
registry. Policies are driven through a real ``Router`` (the view they get in production)."""

from __future__ import annotations

import pytest
from router_helpers import finished, make_req

from sgl_fair.messages import Evicted
from sgl_fair.router import GlobalTree, Router, make_router_policy, router_policy_names
from sgl_fair.router.policies import RouterPolicy, register_router_policy
from sgl_fair.router.policies.preble import Preble


def router(policy: str, num_workers: int = 3, **options) -> Router:
    return Router(make_router_policy(policy, **options), num_workers)


def send(r: Router, tokens, client: str = "c", now: float = 0.0) -> int:
    return r.dispatch(make_req(tokens, client), now).worker


# ---- registry --------------------------------------------------------------------------------


def test_registry_lists_every_policy():
    assert router_policy_names() == [
        "cache-aware",
        "d2lpm",
        "least-load",
        "per-client-rr",
        "preble",
        "rr",
    ]
    for name in router_policy_names():
        policy = make_router_policy(name)
        assert isinstance(policy, RouterPolicy) and policy.name == name


def test_unknown_names_and_options_are_rejected_by_name():
    with pytest.raises(ValueError, match="'nope'.*d2lpm"):
        make_router_policy("nope")
    with pytest.raises(ValueError, match="'preble' has no option 'quantum'"):
        make_router_policy("preble", quantum=1.0)
    with pytest.raises(ValueError, match="'rr' has no option 'x'"):
        make_router_policy("rr", x=1)
    with pytest.raises(ValueError, match="registered twice"):
        register_router_policy("rr")(type("Again", (), {}))


@pytest.mark.parametrize(
    "name,options",
    [
        ("preble", {"window_s": 0.0}),
        ("preble", {"imbalance": -1.0}),
        ("preble", {"output_weight": float("nan")}),
        ("cache-aware", {"cache_threshold": 1.5}),
        ("cache-aware", {"balance_abs_threshold": -1}),
        ("cache-aware", {"max_tree_tokens": 0}),
    ],
)
def test_bad_option_values_are_rejected(name, options):
    with pytest.raises(ValueError, match=name):
        make_router_policy(name, **options)


# ---- rr, per-client-rr, least-load -------------------------------------------------------------


def test_rr_cycles_over_alive_workers_whatever_the_prompt_or_load():
    r = router("rr")
    assert [send(r, (1, 2, 3)) for _ in range(5)] == [0, 1, 2, 0, 1]
    r.remove_worker(2)
    assert [send(r, (1, 2, 3)) for _ in range(3)] == [0, 1, 0]
    r.add_worker(5)
    assert [send(r, (1,)) for _ in range(4)] == [1, 5, 0, 1]


def test_per_client_rr_keeps_one_cycle_per_client():
    r = router("per-client-rr")
    order = [(c, send(r, (7,), c)) for c in "aababbbba"]
    assert order == [
        ("a", 0), ("a", 1), ("b", 0), ("a", 2), ("b", 1),
        ("b", 2), ("b", 0), ("b", 1), ("a", 0),
    ]  # fmt: skip


def test_least_load_picks_the_shortest_queue_lowest_id_on_ties():
    r = router("least-load")
    assert [send(r, (1, 2)) for _ in range(4)] == [0, 1, 2, 0]
    done = make_req((5,))
    r.dispatch(done, 0.0)  # worker 1
    r.handle(finished(1, done), 0.0)
    assert send(r, (1, 2)) == 1  # queues (2, 1, 1): 1 and 2 tie, lowest id wins


# ---- preble ---------------------------------------------------------------------------------

P = tuple(range(100, 110))  # a 10-token prefix


def test_preble_exploits_at_half_hit_ratio_and_explores_below():
    r = router("preble", num_workers=2)
    policy: Preble = r.policy
    assert send(r, P + tuple(range(12))) == 0  # no match: least loaded (tie: lowest id)
    assert send(r, tuple(range(500, 512))) == 1  # worker 0 is more loaded now
    assert policy.load(0, 0.0) == 22 + 2 * 128 and policy.load(1, 0.0) == 12 + 2 * 128
    # Hit 10 >= miss 10: exploit the holder, though worker 1 is lighter (278 <= 1.5 * 268).
    assert send(r, P + tuple(range(600, 610))) == 0
    # Hit 10 < miss 11: explore, the least loaded overall.
    assert send(r, P + tuple(range(700, 711))) == 1


def test_preble_rebalances_a_hot_prefix_off_an_overloaded_worker():
    r = router("preble", num_workers=2)
    policy: Preble = r.policy
    send(r, P + (1,))  # worker 0
    send(r, tuple(range(500, 510)))  # worker 1
    assert send(r, P + (2,)) == 0  # exploit: 267 <= 1.5 * 266
    assert policy.load(0, 0.0) > 1.5 * policy.load(1, 0.0)
    assert send(r, P + (3,)) == 1  # exploit target overloaded: the lightest instead
    assert r.tree.match(P).holders == {0, 1}  # the hot prefix now has two holders


def test_preble_load_window_and_output_correction():
    r = router("preble", num_workers=2)
    policy: Preble = r.policy
    req = make_req(tuple(range(20)))
    r.dispatch(req, 0.0)
    assert policy.load(0, 0.0) == 20 + 2 * 128  # output estimated at the default 128
    r.handle(finished(0, req, range(10)), 5.0)
    assert policy.load(0, 5.0) == 20 + 2 * 10  # corrected to the real output
    assert policy.expected_output_len == 10.0  # the running mean now
    assert policy.load(0, 179.9) == 40 and policy.load(0, 180.0) == 0.0  # 180 s window
    send(r, tuple(range(50, 55)), now=200.0)
    assert policy.load(0, 200.0) == 5 + 2 * 10


# ---- cache-aware ----------------------------------------------------------------------------


def test_cache_aware_follows_a_good_match_while_balanced():
    r = router("cache-aware", num_workers=2)
    prompt = tuple(range(10))
    assert send(r, prompt) == 0
    assert send(r, (99,)) == 1
    assert send(r, (98,)) == 0
    # Queues (2, 1): balanced. 4/10 matched on worker 0 > 0.3: worker 0, not the shorter 1.
    assert send(r, prompt[:4] + tuple(range(50, 56))) == 0
    # 3/10 matched is not > 0.3: the least-loaded worker.
    assert send(r, prompt[:3] + tuple(range(60, 67))) == 1


def test_cache_aware_goes_to_the_shortest_queue_when_imbalanced():
    r = router("cache-aware", num_workers=2)
    prompt = tuple(range(10))
    workers = [send(r, prompt) for _ in range(66)]
    # Queue 0 reaches 65 > 64 (and 65 > 1.5 * 0): the perfect match is abandoned.
    assert workers == [0] * 65 + [1]


class QueueView:
    """A minimal real ``RouterView`` with queue lengths set by hand."""

    def __init__(self, queues: dict[int, int], now: float = 0.0) -> None:
        self.queues = queues
        self.now = now
        self.tree = GlobalTree()

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(sorted(self.queues))

    def queue_len(self, worker: int) -> int:
        return self.queues[worker]


@pytest.mark.parametrize(
    "queues,expected",
    [
        ({0: 200, 1: 135}, 0),  # 65 apart, but 200 <= 1.5 * 135: balanced, the match wins
        ({0: 203, 1: 135}, 1),  # 68 apart and 203 > 202.5: imbalanced
        ({0: 64, 1: 0}, 0),  # 64 apart is not > 64
    ],
)
def test_cache_aware_needs_both_thresholds_to_call_it_imbalanced(queues, expected):
    policy = make_router_policy("cache-aware")
    view = QueueView(queues)
    req = make_req(tuple(range(10)))
    policy.on_dispatched(req, 0, view.tree.match(req.input_ids), view)
    assert policy.select(make_req(req.input_ids), view.tree.match(()), view) == expected


def test_cache_aware_keeps_its_own_tree_which_never_hears_of_evictions():
    r = router("cache-aware", num_workers=2)
    prompt = tuple(range(10))
    send(r, prompt)
    r.handle(Evicted(0, 1.0, ((prompt, 0),)), 1.0)
    assert r.tree.match(prompt).length == 0  # the router's tree knows
    assert send(r, prompt, now=2.0) == 0  # cache-aware still believes worker 0 has it


@pytest.mark.parametrize("now,expected", [(100.0, 0), (130.0, 1)])
def test_cache_aware_trims_its_tree_every_eviction_interval(now, expected):
    r = router("cache-aware", num_workers=2, max_tree_tokens=10, eviction_interval_s=120.0)
    old, new = tuple(range(10)), tuple(range(50, 60))
    assert send(r, old, now=0.0) == 0  # stays in flight: queues (1, 0) from here on
    for t in (1.0, 2.0):  # `new` twice on worker 1, so `old` is the least recently used
        req = make_req(new)
        assert r.dispatch(req, t).worker == 1
        r.handle(finished(1, req), t)
    assert r.policy.tree.total_tokens == 20  # over the limit, but not trimmed before 120 s
    # Before the interval, `old` is remembered on worker 0 and wins over the shorter queue;
    # after it, the tree was trimmed to 10 tokens (LRU first) and load decides.
    assert send(r, old, now=now) == expected
    if now >= 120.0:
        assert r.policy.tree.match(new).per_worker == {1: 10}


def test_cache_aware_forgets_a_removed_worker():
    r = router("cache-aware", num_workers=2)
    prompt = tuple(range(10))
    send(r, prompt)
    r.remove_worker(0)
    assert r.policy.tree.workers() == set()
    assert send(r, prompt) == 1
