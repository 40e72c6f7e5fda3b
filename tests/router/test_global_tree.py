"""The global tree (and the RadixTree methods it relies on) against a naive model.

``router_helpers`` models each worker's holdings as a prefix-closed set of token strings;
a match, an eviction report, a dead worker or a trim is a plain set operation there.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from router_helpers import (
    model_evict,
    model_match,
    nonempty,
    prefixes,
    tree_holdings,
    tree_strings,
)

from sgl_fair.radix import RadixTree
from sgl_fair.router.global_tree import GlobalMatch, GlobalTree

TOKENS = st.lists(st.integers(0, 3), max_size=10).map(tuple)
WORKERS = (0, 1, 2)


# ---- RadixTree.match_owners / insert_matched / discard_lru ---------------------------------


def contents_with_owners(tree: RadixTree) -> dict[tuple[int, ...], frozenset]:
    out = {}
    stack = [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            for i in range(1, len(child.key) + 1):
                out[prefix + child.key[:i]] = frozenset(child.owners)
            stack.append((prefix + child.key, child))
    return out


def path_of(tree: RadixTree, node) -> tuple[int, ...]:
    keys = []
    while node is not tree.root:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


OPS = st.lists(st.tuples(TOKENS, st.sampled_from((None, "a", "b", "c"))), max_size=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(OPS, st.lists(TOKENS, min_size=1, max_size=6))
def test_match_owners_equals_per_owner_matches(inserts, queries):
    tree = RadixTree()
    for tokens, owner in inserts:
        tree.insert(tokens, owner=owner)
    for tokens in queries:
        length, node, owner_lens, node_len, _ = tree.match_owners(tokens, touch=False)
        plain = tree.match(tokens, touch=False)
        assert (length, node) == (plain.length, plain.node)
        assert node_len <= length and path_of(tree, node) == tokens[:node_len]
        expected = {o: tree.match_len(tokens, owner=o) for o in ("a", "b", "c")}
        assert owner_lens == {o: n for o, n in expected.items() if n > 0}


def test_match_owners_mid_edge_credits_the_partial_edge():
    tree = RadixTree()
    tree.insert((1, 2, 3, 4), owner=0)
    tree.insert((1, 2), owner=1)  # splits: (1, 2) {0, 1} ─ (3, 4) {0}
    m = tree.match_owners((1, 2, 3, 9))
    assert (m.length, m.owner_lens) == (3, {0: 3, 1: 2})
    assert m.node is tree.root.children[1] and m.node_len == 2
    m = tree.match_owners((1, 9))  # ends inside the first edge
    assert (m.length, m.owner_lens, m.node, m.node_len) == (1, {0: 1, 1: 1}, tree.root, 0)


def test_match_owners_touches_like_match():
    tree = RadixTree()
    for key in ((1, 1), (2, 2), (3, 3)):
        tree.insert(key, owner="a")
    tree.match_owners((1, 1))
    tree.match_owners((2, 2), touch=False)
    assert tree.evict(2) == [((2, 2), 0)]
    assert tree.evict(2) == [((3, 3), 0)]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(OPS, TOKENS, st.sampled_from((None, "a", "b")), st.sampled_from((None, "insert", "evict")))
def test_insert_matched_equals_insert(setup, tokens, owner, change):
    """Same tree, same result, same eviction order — also when the tree changed in between."""
    fast, slow = RadixTree(), RadixTree()
    for t, o in setup:
        fast.insert(t, owner=o)
        slow.insert(t, owner=o)
    match = fast.match_owners(tokens)
    slow.match(tokens)
    if change == "insert":  # the match goes stale: insert_matched must fall back
        for tree in (fast, slow):
            tree.insert(tokens[:-1] + (9,), owner="c")
    elif change == "evict":
        for tree in (fast, slow):
            tree.evict(3)
    got = fast.insert_matched(tokens, match, owner=owner)
    want = slow.insert(tokens, owner=owner)
    assert (got.prefix_len, got.num_new) == (want.prefix_len, want.num_new)
    fast.check_invariants()
    assert contents_with_owners(fast) == contents_with_owners(slow)
    assert fast.total_tokens == slow.total_tokens
    assert fast.evict(10**9) == slow.evict(10**9)  # same LRU times everywhere


def test_discard_lru_frees_like_evict():
    trees = [RadixTree(), RadixTree()]
    for tree in trees:
        for key in ((1, 2, 3), (1, 2, 4, 4), (5, 5), (6,)):
            tree.insert(key, owner=0)
        tree.match((5, 5))
    evicted = trees[0].evict(4)
    assert trees[1].discard_lru(4) == sum(len(p) - s for p, s in evicted) == 5  # whole leaves
    assert contents_with_owners(trees[0]) == contents_with_owners(trees[1])
    trees[1].check_invariants()


# ---- GlobalTree units ------------------------------------------------------------------------


def test_match_on_empty_tree():
    assert GlobalTree().match((1, 2, 3)) == GlobalMatch(0, frozenset(), {})
    assert GlobalTree().match(()) == GlobalMatch(0, frozenset(), {})


def test_match_reports_longest_holders_and_per_worker_lengths():
    tree = GlobalTree()
    tree.insert((1, 2, 3, 4), 0)
    tree.insert((1, 2, 3, 4, 5, 6), 1)
    tree.insert((1, 2), 2)
    assert tree.match((1, 2, 3, 4, 5, 9)) == GlobalMatch(5, frozenset({1}), {0: 4, 1: 5, 2: 2})
    assert tree.match((1, 2, 3, 4, 7)) == GlobalMatch(4, frozenset({0, 1}), {0: 4, 1: 4, 2: 2})
    assert tree.match((1, 3)) == GlobalMatch(1, frozenset({0, 1, 2}), {0: 1, 1: 1, 2: 1})
    assert tree.match((7,)) == GlobalMatch(0, frozenset(), {})
    tree.check_invariants()


def test_insert_reports_new_tokens_and_reuses_the_last_match():
    tree = GlobalTree()
    prompt = (1, 2, 3, 4)
    assert tree.insert(prompt, 0) == 4
    longer = (1, 2, 3, 4, 5)
    tree.match(longer)
    assert tree.insert(longer, 1) == 1  # through the remembered walk
    assert tree.match(longer).per_worker == {0: 4, 1: 5}
    assert tree.insert([1, 2, 9], 2) == 1  # a list: no fast path, same result
    tree.check_invariants()


def test_evicted_removes_the_worker_from_the_subtree_only():
    tree = GlobalTree()
    tree.insert((1, 2, 3, 4), 0)
    tree.insert((1, 2, 3, 5), 0)
    tree.insert((1, 2, 3, 4), 1)
    assert tree.evicted(0, (1, 2, 3, 4), 2) == 1  # (5,) pruned; (3,) and (4,) kept for 1
    assert tree.match((1, 2, 3, 4)).per_worker == {0: 2, 1: 4}
    assert tree.match((1, 2, 3, 5)).per_worker == {0: 2, 1: 3}
    assert tree.total_tokens == 4
    tree.check_invariants()


@pytest.mark.parametrize(
    "path,start",
    [((), 0), ((9, 9), 0), ((1, 2, 3, 4, 5, 6), 5), ((1, 2), 7), ((1, 2, 3), -3)],
)
def test_evicted_never_fails_on_paths_the_tree_lacks(path, start):
    tree = GlobalTree()
    tree.insert((1, 2, 3), 0)
    before = tree.match((1, 2, 3))
    num = tree.evicted(0, path, start)
    tree.check_invariants()
    if start < 0:  # treated as 0: the whole path
        assert num == 3 and tree.total_tokens == 0
    else:
        assert num == 0 and tree.match((1, 2, 3)) == before
    assert tree.evicted(5, (1, 2, 3), 0) == 0  # a worker that holds nothing


def test_remove_worker_prunes_what_only_it_held():
    tree = GlobalTree()
    tree.insert((1, 2, 3), 0)
    tree.insert((1, 2, 4), 1)
    tree.insert((7, 7), 1)
    assert tree.remove_worker(1) == 3  # (4,) and (7, 7)
    assert tree.workers() == {0}
    assert tree.match((1, 2, 4)) == GlobalMatch(2, frozenset({0}), {0: 2})
    assert tree.remove_worker(1) == 0
    tree.check_invariants()


def test_trim_drops_least_recently_used_leaves_to_the_bound():
    tree = GlobalTree()
    tree.insert((1, 1, 1), 0)
    tree.insert((2, 2, 2), 1)
    tree.insert((3, 3, 3), 2)
    tree.match((1, 1, 1))  # the oldest is now (2, 2, 2)
    assert tree.trim(7) == 3
    assert tree_strings(tree) == (prefixes((1, 1, 1)) | prefixes((3, 3, 3))) - {()}
    assert tree.trim(7) == 0
    assert tree.trim(0) == 6 and tree.total_tokens == 0
    tree.check_invariants()


def test_check_invariants_rejects_an_ownerless_node():
    tree = GlobalTree()
    tree.insert((1, 2), 0)
    tree.check_invariants()
    tree.tree.insert((1, 2, 3))  # a node nobody holds
    with pytest.raises(AssertionError, match="ownerless"):
        tree.check_invariants()


# ---- state machine against the model ----------------------------------------------------------


class GlobalTreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = GlobalTree()
        self.held = {u: {()} for u in WORKERS}
        self.seen: list[tuple[int, ...]] = [()]

    @rule(tokens=TOKENS, worker=st.sampled_from(WORKERS), via_match=st.booleans())
    def insert(self, tokens, worker, via_match):
        if via_match:  # as the router dispatches: match, then insert the same tuple
            assert self.tree.match(tokens) == model_match(self.held, tokens)
        before = set().union(*self.held.values())
        num_new = self.tree.insert(tokens, worker)
        assert num_new == len(prefixes(tokens) - before)
        self.held[worker] |= prefixes(tokens)
        self.seen.append(tokens)

    @rule(data=st.data(), worker=st.sampled_from(WORKERS), start=st.integers(-1, 11))
    def evicted(self, data, worker, start):
        path = data.draw(st.one_of(st.sampled_from(self.seen), TOKENS))
        self.tree.evicted(worker, path, start)
        model_evict(self.held, worker, path, max(start, 0))
        # The ordering guarantee: nothing of path[start:] is credited to `worker` any more.
        assert self.tree.match(path, touch=False).per_worker.get(worker, 0) <= max(start, 0)

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker):
        self.tree.remove_worker(worker)
        self.held[worker] = {()}
        assert worker not in self.tree.workers()

    @precondition(lambda self: self.tree.total_tokens > 0)
    @rule(data=st.data())
    def trim(self, data):
        max_tokens = data.draw(st.integers(0, self.tree.total_tokens))
        self.tree.trim(max_tokens)
        assert self.tree.total_tokens <= max_tokens
        after = tree_holdings(self.tree)
        for u in WORKERS:  # only forgets, never invents; what is left is prefix-closed
            kept = after.get(u, {()})
            assert kept <= self.held[u]
            assert all(s[:-1] in kept for s in kept if s)
            self.held[u] = kept

    @rule(tokens=TOKENS, touch=st.booleans())
    def match(self, tokens, touch):
        assert self.tree.match(tokens, touch=touch) == model_match(self.held, tokens)

    @invariant()
    def agrees_with_model(self):
        self.tree.check_invariants()
        assert tree_holdings(self.tree) == nonempty(self.held)
        assert self.tree.total_tokens == len(set().union(*self.held.values())) - 1
        assert self.tree.workers() == set(nonempty(self.held))


GlobalTreeMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True
)
TestGlobalTreeMachine = GlobalTreeMachine.TestCase


def test_model_helpers_are_not_vacuous():
    """The model notices a wrong answer (so the machine above can fail)."""
    tree = GlobalTree()
    tree.insert((1, 2, 3), 0)
    held = {0: prefixes((1, 2, 3)), 1: {()}}
    assert tree.match((1, 2)) == model_match(held, (1, 2))
    broken = copy.deepcopy(held)
    broken[1] |= prefixes((1,))
    assert tree.match((1, 2)) != model_match(broken, (1, 2))
    assert tree_holdings(tree) != nonempty(broken)
