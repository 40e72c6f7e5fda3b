"""A node of ``sgl_fair.radix.RadixTree``: one edge's tokens and the state kept with it."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

Tokens = tuple[int, ...]


class Node:
    __slots__ = (
        "key",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "owners",
        "version",
        "_in_heap",
        "slots",
    )

    def __init__(self, key: Tokens, parent: Node | None, last_access: int = 0) -> None:
        self.key = key
        self.parent = parent  # None for the root and for nodes removed from the tree
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.owners: set[Hashable] = set()
        # Bumped when a child is added below this node (or its parent) or removed from it:
        # a memoized match that ended here is stale iff the version moved (MatchMemo).
        self.version = 0
        # True while the eviction heap holds an entry for this node (see RadixTree._heap).
        self._in_heap = False
        # Payload, one entry per key token (exact KV cache: device slots); splits with the edge.
        self.slots: list[int] | None = None

    def __repr__(self) -> str:
        state = f"lock_ref={self.lock_ref}, last_access={self.last_access}"
        return f"Node(key={self.key!r}, {state}, owners={self.owners!r})"


class MatchMemo(NamedTuple):
    """A remembered ``match``: valid while ``node`` is attached and its version unchanged.

    A request's match can only grow if a branch is added at the node where it ended, or
    inside the edge it partly matched (which first splits that edge: the split bumps the
    node); it can only shrink if the child it ran into is removed. All three bump
    ``node.version``; changes elsewhere in the tree leave the memo valid. A match of 0 stays
    so while no edge starts with the prompt's first token (``RadixTree.memo_match``).
    """

    node: Node
    version: int
    length: int
