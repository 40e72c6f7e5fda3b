"""The router's global radix tree: which worker holds which prompt prefix.

One ``RadixTree`` whose node owners are worker ids. Owners are downward-closed
(``owners(child) ⊆ owners(parent)``), so "worker u holds this prefix" is a path property::

    root ─ (sys prompt) {0,1} ─┬─ (question a) {0}     worker 0 holds sys+a and sys+b,
                               └─ (question b) {0,1}   worker 1 holds sys+b only

The tree is soft state: dispatches and finished requests add claims, the workers'
eviction reports remove them, a dead worker is dropped everywhere, and ``trim`` bounds
its size. No node survives without an owner: a node nobody holds is pruned at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sgl_fair.radix import OwnersMatch, RadixTree


class GlobalMatch(NamedTuple):
    """One walk's view of a prompt: the longest held prefix and who holds what."""

    length: int  # longest prefix held by any worker (0 if none)
    holders: frozenset[int]  # workers holding all `length` tokens (empty if length is 0)
    per_worker: dict[int, int]  # matched length per worker, only workers with > 0


class GlobalTree:
    def __init__(self) -> None:
        self._tree = RadixTree()
        # The last match, so that inserting the same prompt next (a dispatch) reuses its
        # walk instead of comparing every token again.
        self._last: tuple[tuple[int, ...], OwnersMatch] | None = None

    @property
    def tree(self) -> RadixTree:
        """The underlying radix tree (owners are worker ids): for inspection only — mutate
        it through this class, which keeps every node owned."""
        return self._tree

    @property
    def total_tokens(self) -> int:
        return self._tree.total_tokens

    def match(self, tokens: Sequence[int], *, touch: bool = True) -> GlobalMatch:
        """Match ``tokens`` once, reading every worker's length off the one path.

        ``touch`` refreshes the path's LRU time (``trim`` drops least recently used first).
        """
        walk = self._tree.match_owners(tokens, touch=touch)
        if type(tokens) is tuple:  # immutable: safe to recognise by identity in insert
            self._last = (tokens, walk)
        lens = walk.owner_lens
        if not lens:
            return GlobalMatch(0, frozenset(), {})
        length = max(lens.values())
        holders = frozenset([u for u, n in lens.items() if n == length])
        return GlobalMatch(length, holders, lens)

    def insert(self, tokens: Sequence[int], worker: int) -> int:
        """Record that ``worker`` holds ``tokens`` (and so every prefix); returns new tokens."""
        last = self._last
        if last is not None and last[0] is tokens:
            self._last = None
            return self._tree.insert_matched(tokens, last[1], owner=worker).num_new
        return self._tree.insert(tokens, owner=worker).num_new

    def evicted(self, worker: int, path: Sequence[int], start: int) -> int:
        """``worker`` dropped ``path[start:]`` and everything below it; returns tokens pruned.

        Never fails: a path the tree does not have (or not for this worker) is a no-op.
        """
        return self._tree.remove_owner(path, worker, from_len=start)

    def remove_worker(self, worker: int) -> int:
        """Drop ``worker`` from every node, pruning nodes nobody holds; returns tokens pruned."""
        return self._tree.remove_owner_everywhere(worker)

    def trim(self, max_tokens: int) -> int:
        """Evict least recently used leaves until ``total_tokens <= max_tokens``; returns freed.

        Bounds the router's memory. Dropping a leaf only forgets a claim (the next request
        for it may miss locality), it never makes a claim up.
        """
        excess = self._tree.total_tokens - max(max_tokens, 0)
        if excess <= 0:
            return 0
        return self._tree.discard_lru(excess)

    def workers(self) -> set[int]:
        """Every worker holding anything (the root's children's owners, by downward closure)."""
        held: set[int] = set()
        for child in self._tree.root.children.values():
            held |= child.owners
        return held

    def tokens_by_worker(self) -> dict[int, int]:
        """Tokens the tree credits to each worker (a full walk: for inspection, not dispatch)."""
        out: dict[int, int] = {}
        stack = list(self._tree.root.children.values())
        while stack:
            node = stack.pop()
            for u in node.owners:
                out[u] = out.get(u, 0) + len(node.key)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        """Radix invariants, no locks, and no node without an owner."""
        tree = self._tree
        tree.check_invariants()
        assert tree.locked_tokens == 0, "the global tree never locks"
        stack = list(tree.root.children.values())
        while stack:
            node = stack.pop()
            assert node.owners, f"ownerless node survived: {node!r}"
            assert all(isinstance(u, int) for u in node.owners), f"non-int owner at {node!r}"
            stack.extend(node.children.values())
