"""Following a worker's KV events by handle (``KVEventDecoder.follow`` + ``OwnerFollower``)
keeps the same tree as applying each op by its whole path (``apply``), op for op — also
when the tree drops claims behind the decoder's back (the router's trim, an ``Evicted``
report), and with two workers' decoders writing one shared tree.

And it is what makes an event's cost flat in the prefix depth: below a 16k-token prefix,
a store walks no path from the root (the tree's node count does not move with depth).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kv_decoder_diff import contents, follow, streams

from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.kv_events import BlockRemoved, BlockStored
from sgl_fair.kv_follow import OwnerFollower
from sgl_fair.radix import RadixTree


def _owned(tree: RadixTree, owner: int) -> set[tuple[int, ...]]:
    """Every maximal path ``owner`` holds."""
    out, stack = set(), [((), tree.root)]
    while stack:
        path, node = stack.pop()
        kids = [c for c in node.children.values() if owner in c.owners]
        if not kids and node is not tree.root:
            out.add(path)
        stack.extend((path + c.key, c) for c in kids)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), streams(), st.lists(st.tuples(st.integers(0, 99), st.integers(0, 6))))
def test_following_by_handle_keeps_the_tree_applying_by_path_keeps(a, b, drops):
    ref, tree = RadixTree(), RadixTree()
    decs = {0: (KVEventDecoder(), KVEventDecoder()), 1: (KVEventDecoder(), KVEventDecoder())}
    followers = {u: OwnerFollower(tree, u) for u in decs}
    drops = iter(drops)
    for step in range(max(len(a), len(b))):
        for u, batches in ((0, a), (1, b)):
            if step >= len(batches):
                continue
            by_path, by_handle = decs[u]
            ops = by_path.apply(batches[step])
            for op in ops:  # `follow` of the diff test, for owner u
                if hasattr(op, "start"):
                    ref.remove_owner(op.path, u, from_len=op.start)
                elif hasattr(op, "path"):
                    ref.insert(op.path, owner=u)
                else:
                    for child in list(ref.root.children.values()):
                        ref.remove_owner(child.key[:1], u)
            by_handle.follow(batches[step], followers[u])
            # The tree drops a claim on its own: both trees alike, by path.
            pick = next(drops, None)
            held = sorted(_owned(ref, u))
            if pick is not None and held:
                path = held[pick[0] % len(held)]
                ref.remove_owner(path, u, from_len=pick[1] % len(path))
                tree.remove_owner(path, u, from_len=pick[1] % len(path))
            for w in decs:
                assert _owned(tree, w) == _owned(ref, w), (step, w)
            tree.check_invariants()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_one_owner_by_handle_is_the_diff_tests_follower(batches):
    ref, tree = RadixTree(), RadixTree()
    dec_ref, dec = KVEventDecoder(), KVEventDecoder()
    follower = OwnerFollower(tree, 0)
    for batch in batches:
        follow(ref, dec_ref.apply(batch))
        dec.follow(batch, follower)
        assert contents(tree) == contents(ref)


def test_a_store_below_a_deep_prefix_climbs_no_path():
    """SGLang's shape at page size 1: a 16k-token chain in 32-token nodes, then a node below
    its last page and one below a mid-chain page (a split), stored and removed. Each is
    applied by the handle of the node it hangs below: none by its whole path."""
    dec, tree = KVEventDecoder(), RadixTree()
    follower = OwnerFollower(tree, 0)
    parent, hashes, h = None, [], 1
    for start in range(0, 16_384, 32):
        hs = list(range(h, h + 32))
        h += 32
        dec.follow([BlockStored(hs, parent, [(start + i) % 500 for i in range(32)], 1, None)],
                   follower)  # fmt: skip
        parent = hs[-1]
        hashes += hs
    assert follower.num_by_path == 1  # the first node, below the root: its path is its tokens
    for anchor in (hashes[-1], hashes[len(hashes) // 2 - 5]):
        for r in range(3):
            hs = list(range(h, h + 32))
            h += 32
            dec.follow([BlockStored(hs, anchor, [600 + r] * 32, 1, None)], follower)
            dec.follow([BlockRemoved(hs)], follower)
    assert follower.num_by_path == 1
    assert follower.num_removed == 6 and follower.removed_tokens == 6 * 32
    assert tree.total_tokens == 16_384
    tree.check_invariants()


def test_a_handle_goes_with_its_page():
    """A page forgotten and its offset reused by other tokens: the old page's handle (a node
    still in the tree, held again through another chain) must not stand for the new page."""
    tree = RadixTree()
    dec, other = KVEventDecoder(), KVEventDecoder()
    f0, f1 = OwnerFollower(tree, 0), OwnerFollower(tree, 1)
    other.follow([BlockStored([90, 91, 92, 93], None, [1, 2, 3, 4], 1, None)], f1)
    dec.follow([BlockStored([1, 2, 3, 4], None, [1, 2, 3, 4], 1, None)], f0)
    dec.follow([BlockRemoved([3])], f0)  # worker 0 keeps (1, 2)
    dec.follow([BlockStored([5, 6, 7, 8], None, [1, 2, 3, 4], 1, None)], f0)  # held again
    dec.follow([BlockStored([9, 10, 11], 2, [7, 7, 7], 1, None)], f0)  # (1, 2, 7, 7, 7)
    dec.follow([BlockStored([12], 9, [8], 1, None)], f0)  # below (1, 2, 7): a split
    assert _owned(tree, 0) == {(1, 2, 3, 4), (1, 2, 7, 7, 7), (1, 2, 7, 8)}
    tree.check_invariants()
