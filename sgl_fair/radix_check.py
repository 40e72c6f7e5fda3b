"""``RadixTree.check_invariants``: the whole structure and every counter checked, for tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_fair.radix import RadixTree


def check_tree(tree: RadixTree) -> None:
    """Raise AssertionError if the structure or a counter of ``tree`` is inconsistent."""
    root = tree.root
    assert root.key == () and root.parent is None, "root must have an empty key, no parent"
    assert root.lock_ref == 0, f"root lock_ref must stay 0, got {root.lock_ref}"
    heap_time = {}
    for last_access, _, node in tree._heap:
        heap_time[id(node)] = min(last_access, heap_time.get(id(node), last_access))
    num_nodes, total, evictable = 1, 0, 0
    stack = [root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.key, f"empty key under {node!r}"
            assert child.key[0] == first, f"child {child!r} filed under token {first}"
            assert child.parent is node, f"bad parent pointer at {child!r}"
            assert child.lock_ref >= 0, f"negative lock_ref at {child!r}"
            if node is not root:
                assert node.lock_ref >= child.lock_ref, f"lock_ref above {child!r} too low"
                assert child.owners <= node.owners, f"owners not downward-closed at {child!r}"
            num_nodes += 1
            total += len(child.key)
            if child.lock_ref == 0:
                evictable += len(child.key)
                if not child.children:
                    when = heap_time.get(id(child))
                    assert when is not None and when <= child.last_access, (
                        f"evictable leaf {child!r} has no valid eviction-heap entry"
                    )
            assert child._in_heap == (id(child) in heap_time), f"heap flag wrong at {child!r}"
            stack.append(child)
    assert num_nodes == tree._num_nodes, f"node count {tree._num_nodes} != {num_nodes}"
    assert total == tree._total_tokens, f"total_tokens {tree._total_tokens} != {total}"
    assert evictable == tree._evictable_tokens, (
        f"evictable_tokens {tree._evictable_tokens} != {evictable}"
    )
    assert tree.locked_tokens == total - evictable, "locked_tokens mismatch"
