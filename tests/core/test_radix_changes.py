"""``RadixTree.take_changes``: a match can change only through a change logged where it is
kept — at the node it ended on (or whose child edge it ran partly into), on the token it goes
on with, or by that node leaving the tree. The SGLang plugin's LPM order kept across passes
(``worker/sglang/lpm_index.py``) re-reads only those matches; this is its contract.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.radix import RadixTree

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=8)


def watch_key(tree: RadixTree, tokens: tuple) -> tuple:
    """Where ``tokens``' match is kept: the deepest node whose whole key lies inside it, and
    the token after that node (None if the tokens end there)."""
    m = tree.match(tokens, touch=False)
    depth, up = 0, m.node
    while up is not None:
        depth += len(up.key)
        up = up.parent
    return m.node, (tokens[depth] if depth < len(tokens) else None)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), TOKENS, st.sampled_from("ab")),
        st.tuples(st.just("remove"), TOKENS, st.sampled_from("ab")),
        st.tuples(st.just("evict"), st.integers(1, 6), st.none()),
        st.tuples(st.just("split"), TOKENS, st.none()),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None, database=None)
@given(before=OPS, after=OPS, queries=st.lists(TOKENS, min_size=1, max_size=6))
def test_a_match_changes_only_through_a_change_logged_where_it_is_kept(before, after, queries):
    tree = RadixTree()
    tree.track_changes()

    def apply(ops):
        for op, arg, owner in ops:
            if op == "insert":
                tree.insert(tuple(arg), owner=owner)
            elif op == "remove":
                tree.remove_owner(tuple(arg), owner)
            elif op == "evict":
                tree.evict(arg)
            else:  # a match that cuts the edge where it ends (no content change)
                m = tree.match_owners(tuple(arg), touch=False)
                if m.length > m.node_len:
                    tree.insert_matched(tuple(arg)[: m.length], m, owner="a")
        tree.check_invariants()

    apply(before)
    kept = {tuple(q): (tree.match_len(tuple(q)), watch_key(tree, tuple(q))) for q in queries}
    tree.take_changes()
    apply(after)
    changes = tree.take_changes()
    assert changes is not None
    logged = set(changes)
    for q, (n, (node, t)) in kept.items():
        if (node, t) not in logged and (node, None) not in logged:
            assert tree.match_len(q) == n, (q, n, changes)


def test_the_log_says_none_past_its_limit_and_starts_again():
    tree = RadixTree()
    tree.track_changes(limit=3)
    for i in range(5):
        tree.insert((i, i))
    assert tree.take_changes() is None
    tree.insert((9,))
    assert tree.take_changes() == [(tree.root, 9)]
    with pytest.raises(RuntimeError):
        RadixTree().take_changes()
