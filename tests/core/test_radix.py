"""The token radix tree: unit tests, then a hypothesis state machine against a naive model.

The naive model is the set of token strings the tree holds, closed under prefixes: a tree
storing (1, 2, 3) holds (), (1,), (1, 2) and (1, 2, 3). Every token in the tree is exactly
one non-empty string of that set, so counts, matches, evictions and pruning can all be
predicted from plain set operations.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgl_fair.radix import Node, RadixTree


def path_of(tree: RadixTree, node: Node) -> tuple[int, ...]:
    keys = []
    while node is not tree.root:
        keys.append(node.key)
        node = node.parent
    return tuple(token for key in reversed(keys) for token in key)


def contents(tree: RadixTree) -> set[tuple[int, ...]]:
    """Every token string the tree holds (prefix-closed, includes ())."""
    held = {()}
    stack = [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            for i in range(1, len(child.key) + 1):
                held.add(prefix + child.key[:i])
            stack.append((prefix + child.key, child))
    return held


def longest_prefix(model: set[tuple[int, ...]], tokens: tuple[int, ...]) -> int:
    length = 0
    while length < len(tokens) and tokens[: length + 1] in model:
        length += 1
    return length


# ---- unit tests ----------------------------------------------------------------------------


def test_match_on_empty_tree():
    tree = RadixTree()
    assert tree.match((1, 2, 3)) == (0, tree.root)
    assert tree.match(()) == (0, tree.root)
    assert tree.match_len((1,)) == 0
    assert tree.total_tokens == tree.evictable_tokens == tree.locked_tokens == 0
    tree.check_invariants()


def test_insert_then_match_exact_partial_and_mid_edge():
    tree = RadixTree()
    leaf = tree.insert([1, 2, 3, 4]).node  # any sequence is accepted
    assert leaf.key == (1, 2, 3, 4)
    assert tree.match((1, 2, 3, 4)) == (4, leaf)
    assert tree.match((1, 2, 3, 4, 5, 6)) == (4, leaf)
    # Ends mid-edge: the length counts the partial edge, the node is the edge's parent, and
    # nothing is split.
    assert tree.match((1, 2, 9)) == (2, tree.root)
    assert tree.match((1, 2)) == (2, tree.root)
    assert tree.match((9, 1)) == (0, tree.root)
    assert tree.match_len((1, 2, 3, 7)) == 3
    assert list(tree.root.children.values()) == [leaf]
    tree.check_invariants()


def test_match_compares_the_whole_edge_even_when_its_last_token_agrees():
    """``match`` skips the edge compare when the last tokens differ; equal last tokens must
    still compare the whole edge."""
    tree = RadixTree()
    leaf = tree.insert((1, 2, 3, 4, 5)).node
    for tokens, length in [((1, 2, 9, 4, 5), 2), ((1, 9, 3, 4, 5, 6), 1), ((1, 2, 3, 4, 9), 4)]:
        assert tree.match(tokens) == (length, tree.root)
        om = tree.match_owners(tokens)
        assert (om.length, om.node, om.node_len) == (length, tree.root, 0)
    assert tree.match((1, 2, 3, 4, 5, 9)) == (5, leaf)
    assert tree.match_owners((1, 2, 3, 4, 5)).length == 5


def test_insert_splits_an_edge():
    tree = RadixTree()
    lower = tree.insert((1, 2, 3, 4)).node
    result = tree.insert((1, 2, 5))
    upper = tree.root.children[1]
    assert upper.key == (1, 2)
    assert set(upper.children) == {3, 5}
    assert upper.children[3] is lower and lower.key == (3, 4)  # the old node is the lower part
    assert result.node is upper.children[5] and result.node.key == (5,)
    assert tree.match((1, 2, 3)) == (3, upper)
    # Inserting a prefix that ends mid-edge splits too, and the returned node ends there.
    mid = tree.insert((1, 2, 3)).node
    assert mid.key == (3,) and mid.children[4] is lower and lower.key == (4,)
    assert path_of(tree, mid) == (1, 2, 3)
    assert tree.total_tokens == 5
    tree.check_invariants()


def test_insert_reports_prefix_len_and_num_new():
    tree = RadixTree()
    assert tree.insert((1, 2, 3)) == (0, tree.root.children[1], 3)
    first, _, num_new = tree.insert((1, 2, 3, 4, 5))
    assert (first, num_new) == (3, 2)
    prefix_len, node, num_new = tree.insert((1, 2))
    assert (prefix_len, num_new) == (2, 0) and path_of(tree, node) == (1, 2)
    assert tree.insert((1, 7))[::2] == (1, 1)
    assert tree.insert(()) == (0, tree.root, 0)
    assert tree.total_tokens == 6
    tree.check_invariants()


def test_locked_nodes_are_never_evicted():
    tree = RadixTree()
    tree.insert((1, 2, 3))
    handle = tree.insert((1, 2, 4)).node
    tree.lock(handle)
    assert (tree.locked_tokens, tree.evictable_tokens) == (3, 1)
    assert tree.evict(10**9) == [((1, 2, 3), 2)]
    assert tree.match_len((1, 2, 4)) == 3
    assert (tree.total_tokens, tree.locked_tokens, tree.evictable_tokens) == (3, 3, 0)
    assert tree.evict(10**9) == []
    tree.check_invariants()
    tree.unlock(handle)
    assert tree.evict(10**9) == [((1, 2, 4), 2), ((1, 2), 0)]
    assert tree.total_tokens == 0
    tree.check_invariants()


def test_lock_refs_count_and_unlock_below_zero_raises():
    tree = RadixTree()
    handle = tree.insert((1, 2)).node
    tree.lock(handle)
    tree.lock(handle)
    tree.unlock(handle)
    assert handle.lock_ref == 1 and tree.evict(5) == []
    tree.unlock(handle)
    with pytest.raises(ValueError):
        tree.unlock(handle)
    tree.check_invariants()
    tree.evict(5)
    with pytest.raises(ValueError):  # an evicted handle must not be used again
        tree.lock(handle)


def test_split_above_a_locked_node_keeps_its_lock():
    tree = RadixTree()
    handle = tree.insert((1, 2, 3, 4)).node
    tree.lock(handle)
    tree.insert((1, 2, 9))  # splits the locked edge
    upper = tree.root.children[1]
    assert upper.lock_ref == 1 and handle.parent is upper
    assert path_of(tree, handle) == (1, 2, 3, 4)
    tree.check_invariants()
    assert tree.evict(100) == [((1, 2, 9), 2)]
    tree.unlock(handle)
    assert upper.lock_ref == handle.lock_ref == 0
    assert tree.evictable_tokens == tree.total_tokens == 4
    tree.check_invariants()


def test_evict_takes_the_least_recently_used_leaf_first():
    tree = RadixTree()
    tree.insert((1, 1, 1))
    tree.insert((2, 2, 2))
    tree.insert((3, 3, 3))
    assert tree.evict(1) == [((1, 1, 1), 0)]  # whole leaf: may free more than asked
    assert tree.total_tokens == 6
    assert tree.evict(4) == [((2, 2, 2), 0), ((3, 3, 3), 0)]
    tree.check_invariants()


def test_match_touch_refreshes_lru_and_touch_false_does_not():
    tree = RadixTree()
    tree.insert((1, 1))
    tree.insert((2, 2))
    tree.insert((3, 3))
    tree.match((1, 1))  # (1, 1) is now the most recent
    tree.match((2, 2), touch=False)
    tree.match_len((2, 2))
    assert tree.evict(2) == [((2, 2), 0)]
    assert tree.evict(2) == [((3, 3), 0)]
    tree.check_invariants()


def test_evict_returns_paths_and_frees_parents_that_become_leaves():
    tree = RadixTree()
    tree.insert((1, 2, 3, 4))
    tree.insert((1, 2, 5))
    tree.insert((7,))
    evicted = tree.evict(100)
    assert evicted == [((1, 2, 3, 4), 2), ((1, 2, 5), 2), ((1, 2), 0), ((7,), 0)]
    assert sum(len(path) - start for path, start in evicted) == 6
    assert tree.total_tokens == 0 and tree.root.children == {}
    assert tree.evict(1) == []
    tree.check_invariants()


def test_owner_aware_match():
    tree = RadixTree()
    tree.insert((1, 2, 3, 4), owner="a")
    tree.insert((1, 2, 3, 9), owner="b")
    tree.insert((1, 2, 3, 9, 9))  # no owner: invisible to owner-aware matches
    upper = tree.root.children[1]
    assert upper.owners == {"a", "b"}
    assert tree.match((1, 2, 3, 4), owner="a") == (4, upper.children[4])
    assert tree.match((1, 2, 3, 4), owner="b") == (3, upper)
    assert tree.match_len((1, 2, 3, 9, 9), owner="b") == 4
    assert tree.match_len((1, 2, 3, 9, 9)) == 5
    assert tree.match_len((1, 2, 3), owner="c") == 0
    tree.check_invariants()


def test_remove_owner_prunes_only_nodes_it_emptied():
    tree = RadixTree()
    tree.insert((1, 2, 3, 4), owner="a")
    tree.insert((1, 2, 5), owner="b")
    assert tree.remove_owner((1, 2, 3, 4), "a") == 2  # (3, 4) pruned, (1, 2) kept for b
    assert tree.root.children[1].owners == {"b"}
    assert tree.match_len((1, 2, 3, 4), owner="a") == 0
    assert tree.match_len((1, 2, 5), owner="b") == 3
    assert tree.total_tokens == 3
    assert tree.remove_owner((1, 2, 5), "a") == 0  # does not hold it: no-op
    assert tree.remove_owner((8, 8), "b") == 0  # not in the tree
    tree.check_invariants()


def test_remove_owner_from_len_splits_mid_edge():
    tree = RadixTree()
    tree.insert((1, 2, 3, 4, 5, 6), owner="a")
    assert tree.remove_owner((1, 2, 3, 4, 5, 6), "a", from_len=3) == 3
    assert tree.root.children[1].key == (1, 2, 3)
    assert tree.match_len((1, 2, 3, 4, 5, 6), owner="a") == 3
    assert tree.remove_owner((1, 2, 3), "a", from_len=3) == 0  # nothing at or past 3
    tree.check_invariants()


def test_remove_owner_clears_the_whole_subtree_but_spares_ownerless_and_locked_nodes():
    tree = RadixTree()
    tree.insert((1, 2), owner="a")
    tree.insert((1, 2, 3), owner="a")
    handle = tree.insert((1, 2, 4), owner="a").node
    tree.insert((1, 2, 5, 5))  # owner-less worker-cache entry below an owned node
    tree.lock(handle)
    # Only (1, 2) is on the given path, yet every descendant loses "a" (downward closure).
    assert tree.remove_owner((1, 2), "a") == 1  # only (3,) is pruned
    node = tree.root.children[1]
    assert node.owners == set() and set(node.children) == {4, 5}
    assert handle.owners == set() and handle.lock_ref == 1
    assert tree.match_len((1, 2, 5, 5)) == 4
    tree.check_invariants()


def test_check_invariants_catches_corruption():
    tree = RadixTree()
    tree.insert((1, 2, 3), owner="a")
    leaf = tree.insert((1, 2, 4), owner="a").node
    tree.check_invariants()
    leaf.owners.add("b")  # owners must be downward-closed
    with pytest.raises(AssertionError, match="downward"):
        tree.check_invariants()
    leaf.owners.discard("b")
    leaf.lock_ref = 1  # lock_ref set without locking the ancestors or moving counters
    with pytest.raises(AssertionError):
        tree.check_invariants()
    leaf.lock_ref = 0
    tree._total_tokens += 1
    with pytest.raises(AssertionError, match="total_tokens"):
        tree.check_invariants()


# ---- property test: a state machine against the naive model --------------------------------

TOKENS = st.lists(st.integers(0, 3), max_size=12).map(tuple)
OWNERS = ("a", "b")


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree()
        self.present: set[tuple[int, ...]] = {()}
        self.held = {owner: {()} for owner in OWNERS}
        self.locks: list[tuple[Node, tuple[int, ...]]] = []

    def _add(self, tokens: tuple[int, ...], owner: str | None) -> None:
        prefixes = {tokens[:i] for i in range(len(tokens) + 1)}
        self.present |= prefixes
        if owner is not None:
            self.held[owner] |= prefixes

    def _is_locked(self, prefix: tuple[int, ...]) -> bool:
        return any(path[: len(prefix)] == prefix for _, path in self.locks)

    @rule(tokens=TOKENS, owner=st.sampled_from((None, *OWNERS)))
    def insert(self, tokens, owner):
        expected_prefix_len = longest_prefix(self.present, tokens)
        total_before = self.tree.total_tokens
        prefix_len, node, num_new = self.tree.insert(tokens, owner=owner)
        assert prefix_len == expected_prefix_len
        assert num_new == len(tokens) - prefix_len
        assert path_of(self.tree, node) == tokens
        assert self.tree.total_tokens == total_before + num_new
        self._add(tokens, owner)

    @rule(tokens=TOKENS, owner=st.sampled_from((None, *OWNERS)), touch=st.booleans())
    def match(self, tokens, owner, touch):
        model = self.present if owner is None else self.held[owner]
        expected = longest_prefix(model, tokens)
        length, node = self.tree.match(tokens, owner=owner, touch=touch)
        assert length == expected
        assert self.tree.match_len(tokens, owner=owner) == expected
        depth = len(path_of(self.tree, node))
        assert path_of(self.tree, node) == tokens[:depth] and depth <= length
        if depth < length:  # ended mid-edge: node is that edge's parent
            assert depth + len(node.children[tokens[depth]].key) > length

    @rule(tokens=TOKENS, via_insert=st.booleans())
    def lock(self, tokens, via_insert):
        if via_insert:
            node = self.tree.insert(tokens).node
            self._add(tokens, None)
        else:
            node = self.tree.match(tokens).node
        self.tree.lock(node)
        self.locks.append((node, path_of(self.tree, node)))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(node)

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens):
        total_before = self.tree.total_tokens
        evictable_before = self.tree.evictable_tokens
        evicted = self.tree.evict(num_tokens)
        num_freed = sum(len(path) - start for path, start in evicted)
        assert self.tree.total_tokens == total_before - num_freed
        assert min(num_tokens, evictable_before) <= num_freed <= evictable_before
        if evicted:  # stops at the first leaf that reaches the target
            path, start = evicted[-1]
            assert num_freed - (len(path) - start) < num_tokens
        for path, start in evicted:
            assert 0 <= start < len(path) and path in self.present
            branch = path[: start + 1]
            dropped = {p for p in self.present if len(p) > start and p[: start + 1] == branch}
            # A leaf was removed: everything dropped lies on its path, none of it locked.
            assert all(path[: len(p)] == p and not self._is_locked(p) for p in dropped)
            self.present -= dropped
            for owner in OWNERS:
                self.held[owner] -= dropped

    @rule(tokens=TOKENS, owner=st.sampled_from(OWNERS), from_len=st.integers(0, 12))
    def remove_owner(self, tokens, owner, from_len):
        branch = tokens[: from_len + 1]
        cleared = {p for p in self.held[owner] if len(p) > from_len and p[: from_len + 1] == branch}
        self.held[owner] -= cleared

        def prunable(prefix):
            return (
                prefix in cleared
                and not any(prefix in self.held[other] for other in OWNERS)
                and not self._is_locked(prefix)
            )

        # A token goes iff it and everything below it was emptied by this call and unlocked.
        pruned = {p for p in cleared if all(prunable(q) for q in self.present if q[: len(p)] == p)}
        assert self.tree.remove_owner(tokens, owner, from_len=from_len) == len(pruned)
        self.present -= pruned

    @invariant()
    def agrees_with_model(self):
        tree = self.tree
        tree.check_invariants()
        assert contents(tree) == self.present
        assert tree.total_tokens == len(self.present) - 1
        assert tree.locked_tokens == sum(1 for p in self.present if p and self._is_locked(p))
        for node, path in self.locks:
            assert path_of(tree, node) == path
            assert tree.match_len(path) == len(path)
        for owner in OWNERS:
            assert self.held[owner] <= self.present


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, derandomize=True
)
TestRadixMachine = RadixMachine.TestCase


# ---------------------------------------------------------------------------------------------
# Memoized matches stay exact across unrelated changes and go stale on related ones.


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=8),
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "evict"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=10),
        ),
        max_size=25,
    ),
)
def test_memo_match_always_equals_fresh_match(prompts, ops):
    tree = RadixTree()
    prompts = [tuple(p) for p in prompts]
    memos = {p: tree.memo_match(p, None) for p in prompts}
    for op, seq in ops:
        if op == "insert":
            tree.insert(tuple(seq))
        else:
            tree.evict(len(seq))
        for p in prompts:
            memos[p] = tree.memo_match(p, memos[p])
            assert memos[p].length == tree.match_len(p), (p, op, seq)
