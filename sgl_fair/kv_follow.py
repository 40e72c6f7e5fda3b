"""A radix tree that follows one worker's KV events, by handle: O(new tokens) per event.

``KVEventDecoder.follow(batch, follower)`` tells a ``TreeFollower`` each store and removal.
``OwnerFollower`` applies them to a ``RadixTree`` as one owner's claims (the router's
global tree: a worker id; the SGLang plugin's shadow: its one owner). Each store returns
the tree node ending at its last token, which the decoder keeps with that page; a later
event below (SGLang's next radix node, a node split, a removal) comes back with that node
and the tokens between, and the tree climbs from it rather than walking the whole path
from the root — at 32k tokens of prefix that walk was most of an event's cost. A node the
tree dropped since (evicted, trimmed, the owner removed) is refused by ``insert_below`` /
``remove_owner_below``, and the op is applied by its whole path instead (``num_by_path``).

A tree that is replaced must tell the decoder (``KVEventDecoder.drop_handles``): handles
into the old tree would still look attached.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from sgl_fair.radix import RadixTree
from sgl_fair.radix_node import Node, Tokens


class OwnerFollower:
    """``owner``'s claims in ``tree``, kept by a decoder's ops (``kv_decoder.TreeFollower``)."""

    def __init__(self, tree: RadixTree, owner: Hashable) -> None:
        self.tree = tree
        self.owner = owner
        self.num_ops = 0
        self.num_by_path = 0  # ops applied by their whole path (no usable handle)
        self.num_removed = 0
        self.removed_tokens = 0  # tokens pruned by removals

    def stored(
        self, base: object | None, up: int, tokens: Tokens, path: Callable[[], Tokens]
    ) -> Node:
        self.num_ops += 1
        if isinstance(base, Node):
            done = self.tree.insert_below(base, up, tokens, owner=self.owner)
            if done is not None:
                return done.node
        self.num_by_path += 1
        return self.tree.insert(path(), owner=self.owner).node

    def removed(self, base: object | None, up: int, path: Callable[[], tuple[Tokens, int]]) -> None:
        self.num_ops += 1
        self.num_removed += 1
        pruned = None
        if isinstance(base, Node):
            pruned = self.tree.remove_owner_below(base, up, self.owner)
        if pruned is None:
            self.num_by_path += 1
            full, start = path()
            pruned = self.tree.remove_owner(full, self.owner, from_len=start)
        self.removed_tokens += pruned

    def cleared(self) -> None:
        """The owner's claims go everywhere (other owners' stay: the tree may be shared)."""
        self.num_ops += 1
        self.removed_tokens += self.tree.remove_owner_everywhere(self.owner)


__all__ = ["OwnerFollower"]
