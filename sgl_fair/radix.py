"""Token radix tree: the KV prefix cache of a worker and the global router's locality map.

Each edge holds a run of tokens (``Node.key``); a node stands for the whole path from the
root to the end of its key::

    root ─ (1, 2) ─┬─ (3, 4)      sequences (1, 2, 3, 4) and (1, 2, 5) share the node (1, 2);
                   └─ (5,)        children are found by their key's first token

Invariants (``check_invariants()`` proves them; tests call it after every operation):

* handles (nodes) must be locked before use: an unlocked node may be evicted by the next
  ``evict`` and must then not be used again; a locked node keeps its identity and its path,
  even when a later insert splits an edge above it (the split adds the *upper* node);
* ``lock_ref`` counts the locks on a node and its descendants: locking a node pins every
  ancestor, so ``parent.lock_ref >= child.lock_ref`` and locked tokens are never evicted;
* ``evict`` removes whole least-recently-used unlocked leaves, so it may free more than asked;
* ``match`` never splits: if it ends mid-edge, ``length`` counts the partial edge but ``node``
  is that edge's parent. To pin all ``length`` tokens, ``insert(tokens[:length])`` (which
  splits) and lock the node it returns;
* ``owners`` (the router's worker ids) are downward-closed: ``owners(child) ⊆ owners(parent)``,
  so "worker u holds this prefix" is a path property and an owner-aware match stops at the
  first node without ``u``;
* ``total_tokens == evictable_tokens + locked_tokens``, each maintained in O(1);
* access times are a logical clock (one tick per ``match``/``insert``): eviction order is
  deterministic in tests and in the simulator.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from itertools import chain
from typing import NamedTuple

from sgl_fair.radix_node import MatchMemo, Node, Tokens


class MatchResult(NamedTuple):
    length: int  # number of leading tokens matched
    node: Node  # deepest node whose whole key lies inside the match (root if none)


class InsertResult(NamedTuple):
    prefix_len: int  # tokens already present before this insert
    node: Node  # node whose key ends exactly at len(tokens)
    num_new: int  # tokens newly added (= len(tokens) - prefix_len)


def common_len(key: Tokens, tokens: Tokens, start: int) -> int:
    """Common prefix length of ``key`` and ``tokens[start:]``: bisects with slice compares
    (C speed), O(log n) compares instead of n Python steps."""
    lo, hi = 0, min(len(key), len(tokens) - start)  # key[:lo] == tokens[start:start+lo]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[lo:mid] == tokens[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class OwnersMatch(NamedTuple):
    length: int  # number of leading tokens matched, owners or not
    node: Node  # deepest node whose whole key lies inside the match (root if none)
    owner_lens: dict[Hashable, int]  # per owner holding > 0 tokens: how many it holds
    node_len: int  # tokens from the root to the end of `node`'s key
    version: int  # the tree's shape stamp when matched (see RadixTree.insert_matched)


class RadixTree:
    def __init__(self) -> None:
        self.root = Node((), None)
        self._clock = 0
        self._version = 0
        self._num_nodes = 1
        self._total_tokens = 0
        self._evictable_tokens = 0
        # Min-heap of (last_access, seq, node) over unlocked leaves, invalidated lazily:
        # touches do not update it (matching stays cheap); evict re-pushes entries whose
        # time has moved on and drops entries of nodes that are no longer evictable leaves.
        # Every evictable leaf has an entry with a time <= its own, so the first current
        # entry popped is the true LRU leaf. `_in_heap` keeps it to one entry per node.
        self._heap: list[tuple[int, int, Node]] = []
        self._push_seq = 0
        self._changes: list[tuple[Node, object]] | None = None  # track_changes()
        self._change_limit = 0

    # ---- counters ------------------------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    @property
    def evictable_tokens(self) -> int:
        return self._evictable_tokens

    @property
    def locked_tokens(self) -> int:
        return self._total_tokens - self._evictable_tokens

    # ---- lookup --------------------------------------------------------------------------

    def match(
        self, tokens: Sequence[int], *, owner: Hashable | None = None, touch: bool = True
    ) -> MatchResult:
        """Longest prefix of ``tokens`` in the tree (held by ``owner`` if given)."""
        tokens = tuple(tokens)
        n = len(tokens)
        node, pos = self.root, 0
        tick = self._tick() if touch else 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None or (owner is not None and owner not in child.owners):
                break
            key = child.key
            end = pos + len(key)
            if end > n or tokens[end - 1] != key[-1] or tokens[pos:end] != key:  # inside the edge
                pos += common_len(key, tokens, pos)
                break
            if touch:
                child.last_access = tick
            node, pos = child, end
        return MatchResult(pos, node)

    def match_owners(self, tokens: Sequence[int], *, touch: bool = True) -> OwnersMatch:
        """``match`` plus, in the same walk, every owner's matched length.

        ``owner_lens[o] == match_len(tokens, owner=o)`` for every owner holding at least one
        token of the prefix. Owners are downward-closed, so an owner's length is the depth
        where it last appears along the path; a match ending inside an edge credits the
        partial tokens to that edge's owners (they hold the whole edge).
        """
        tokens = tuple(tokens)  # no copy when given a tuple
        n = len(tokens)
        node, pos = self.root, 0
        tick = self._tick() if touch else 0
        owner_lens: dict[Hashable, int] = {}
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if end > n or tokens[end - 1] != key[-1] or tokens[pos:end] != key:  # inside the edge
                length = pos + common_len(key, tokens, pos)
                for owner in child.owners:
                    owner_lens[owner] = length
                return OwnersMatch(length, node, owner_lens, pos, self._version)
            if touch:
                child.last_access = tick
            for owner in child.owners:
                owner_lens[owner] = end
            node, pos = child, end
        return OwnersMatch(pos, node, owner_lens, pos, self._version)

    def match_len(self, tokens: Sequence[int], *, owner: Hashable | None = None) -> int:
        """``match(tokens, owner=owner, touch=False).length``."""
        return self.match(tokens, owner=owner, touch=False).length

    def memo_match(self, tokens: Sequence[int], memo: MatchMemo | None) -> MatchMemo:
        """``match_len`` for a prompt matched before: O(1) when nothing on its path changed."""
        if memo is not None:
            node = memo.node
            if node.version == memo.version and (node.parent is not None or node is self.root):
                return memo
            if not memo.length and node is self.root and tokens and tokens[0] not in node.children:
                return memo  # a unique prompt: still no edge to enter
        m = self.match(tokens, touch=False)
        return MatchMemo(m.node, m.node.version, m.length)

    # ---- mutation ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], *, owner: Hashable | None = None) -> InsertResult:
        """Add the missing suffix of ``tokens``; touch the path; add ``owner`` along it."""
        return self._insert_from(self.root, tuple(tokens), owner)

    def insert_below(
        self, node: Node, up: int, tokens: Sequence[int], *, owner: Hashable | None = None
    ) -> InsertResult | None:
        """``insert(path + tokens, owner=owner)``, ``path`` ending ``up`` tokens above the end
        of ``node``'s key (a node kept from an earlier insert through that point): O(tokens +
        nodes climbed), no walk from the root. None if ``node`` cannot stand for it (removed,
        not ``owner``'s — owners are downward-closed —, or ``up`` beyond its depth): insert
        the whole path then. ``prefix_len`` counts from the point."""
        point = self._point(node, up, owner)
        if point is None:
            return None
        return self._insert_from(point, tuple(tokens), owner)

    def remove_owner_below(self, node: Node, up: int, owner: Hashable) -> int | None:
        """``remove_owner(path, owner, from_len=len(path) - up)``, ``path`` being ``node``'s
        and ``up`` ≥ 1: O(nodes climbed + subtree). None as for ``insert_below``."""
        if up < 1 or node.parent is None or owner not in node.owners:
            return None
        while up > len(node.key):
            up -= len(node.key)
            node = node.parent
            if node is self.root:
                return None
        if up < len(node.key):
            self._split(node, len(node.key) - up)  # `node` stays the lower part
        return self._drop_owner(node, owner)

    def _point(self, node: Node, up: int, owner: Hashable | None) -> Node | None:
        """The node ending ``up`` tokens above ``node``'s end (an edge cut there if needed)."""
        if node.parent is None or (owner is not None and owner not in node.owners):
            return None
        while up >= len(node.key) and up:
            up -= len(node.key)
            node = node.parent
            if node is self.root:
                return node if not up else None
        return self._split(node, len(node.key) - up) if up else node

    def _insert_from(self, node: Node, tokens: Tokens, owner: Hashable | None) -> InsertResult:
        n = len(tokens)
        tick = self._tick()
        pos = 0
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = self._add_leaf(node, tokens[pos:], tick)
                if owner is not None:
                    leaf.owners.add(owner)
                return InsertResult(pos, leaf, n - pos)
            key = child.key
            end = pos + len(key)
            if tokens[pos:end] != key:
                # Diverges (or ends) inside this edge: cut it there so a node ends at the
                # divergence point; the new upper node is then on our path.
                split_at = common_len(key, tokens, pos)
                child = self._split(child, split_at)
                end = pos + split_at
            child.last_access = tick
            if owner is not None:
                child.owners.add(owner)
            node, pos = child, end
        return InsertResult(n, node, 0)

    def insert_matched(
        self, tokens: Sequence[int], match: OwnersMatch, *, owner: Hashable | None = None
    ) -> InsertResult:
        """``insert(tokens, owner=owner)`` reusing ``match = match_owners(tokens)``'s walk.

        The matched path is found again from ``match.node`` through parent pointers, with no
        token comparisons. Valid while the tree's shape is unchanged since the match (every
        leaf added, edge split or node removed moves ``version``); otherwise this is a
        plain ``insert``.
        """
        tokens = tuple(tokens)
        if match.version != self._version:
            return self.insert(tokens, owner=owner)
        n = len(tokens)
        tick = self._tick()
        node, pos = match.node, match.node_len
        above = node
        while above is not self.root:
            above.last_access = tick
            if owner is not None:
                above.owners.add(owner)
            above = above.parent
        if match.length > pos:
            # The match ended inside the edge below `node`, short of its end: cut it there
            # (the rest of `tokens`, if any, diverges at that point).
            child = self._split(node.children[tokens[pos]], match.length - pos)
            child.last_access = tick
            if owner is not None:
                child.owners.add(owner)
            node, pos = child, match.length
        if pos == n:
            return InsertResult(n, node, 0)
        leaf = self._add_leaf(node, tokens[pos:], tick)  # no child starts with tokens[pos]
        if owner is not None:
            leaf.owners.add(owner)
        return InsertResult(pos, leaf, n - pos)

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors against eviction (SGLang's inc_lock_ref)."""
        self._check_attached(node)
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``; raises ValueError if ``node`` is not locked."""
        self._check_attached(node)
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        # Ancestors have lock_ref >= node.lock_ref > 0, so no count can go negative.
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_tokens += len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, num_tokens: int, *, slots: list | None = None) -> list[tuple[Tokens, int]]:
        """Remove LRU unlocked leaves until ``num_tokens`` are freed or none is left.

        Returns ``(path, start)`` per removed node: its token path from the root and its key's
        offset in it (``path[start:]`` dropped); ``slots`` (a list) gets each one's payload.
        """
        evicted: list[tuple[Tokens, int]] = []

        def report(node: Node) -> None:
            path = self._path(node)
            evicted.append((path, len(path) - len(node.key)))
            if slots is not None:
                slots.extend(node.slots)

        self._evict_lru(num_tokens, report)
        return evicted

    def discard_lru(self, num_tokens: int) -> int:
        """``evict`` for a caller that needs no paths (they dominate its cost): tokens freed."""
        return self._evict_lru(num_tokens, None)

    def _evict_lru(self, num_tokens: int, report: Callable[[Node], None] | None) -> int:
        num_freed = 0
        heap = self._heap
        while num_freed < num_tokens and heap:
            last_access, _, node = heapq.heappop(heap)
            node._in_heap = False
            if node.parent is None or node.children or node.lock_ref > 0:
                continue  # stale: removed, grown into an inner node, or locked since
            if last_access != node.last_access:
                self._push(node)  # touched since it was pushed: requeue at its real time
                continue
            if report is not None:
                report(node)
            num_freed += len(node.key)
            self._remove_leaf(node)
        return num_freed

    def remove_owner_everywhere(self, owner: Hashable) -> int:
        """``remove_owner`` below every child of the root; returns the tokens pruned."""
        pruned = 0
        for child in list(self.root.children.values()):
            if owner in child.owners:  # downward-closed: no owner below means none deeper
                pruned += self.remove_owner(child.key[:1], owner)
        return pruned

    def remove_owner(self, tokens: Sequence[int], owner: Hashable, *, from_len: int = 0) -> int:
        """Drop ``owner`` from every node covering ``tokens[from_len:]`` and below.

        The subtree under position ``from_len`` of ``tokens`` loses ``owner`` (an edge
        straddling ``from_len`` is split there). Nodes whose owner set this call emptied are
        pruned if unlocked and childless, bottom-up. Returns the number of tokens pruned.
        """
        tokens = tuple(tokens)
        from_len = max(from_len, 0)
        if from_len >= len(tokens):
            return 0
        node, pos = self.root, 0
        while True:  # find the edge holding position from_len along tokens
            child = node.children.get(tokens[pos])
            if child is None:
                return 0
            end = pos + len(child.key)
            limit = min(end, from_len + 1)
            if tokens[pos:limit] != child.key[: limit - pos]:
                return 0  # tokens leave the tree before from_len
            if end > from_len:
                break
            node, pos = child, end
        if owner not in child.owners:
            return 0  # downward-closed: nobody below holds it either
        if pos < from_len:
            self._split(child, from_len - pos)  # `child` stays the lower part
        return self._drop_owner(child, owner)

    def _drop_owner(self, child: Node, owner: Hashable) -> int:
        # Pre-order over the nodes holding `owner`; reversed, children come before parents,
        # so a parent whose children were all pruned is seen childless.
        visited: list[Node] = []
        stack = [child]
        while stack:
            current = stack.pop()
            current.owners.discard(owner)
            visited.append(current)
            stack.extend(c for c in current.children.values() if owner in c.owners)
        num_pruned = 0
        for current in reversed(visited):
            if not current.owners and current.lock_ref == 0 and not current.children:
                num_pruned += len(current.key)
                self._remove_leaf(current)
        # Pruned nodes leave dead heap entries behind; compact before they dominate.
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [entry for entry in self._heap if entry[2].parent is not None]
            heapq.heapify(self._heap)
        return num_pruned

    def track_changes(self, limit: int = 1 << 16) -> None:
        """Log every edge change from now on, for ``take_changes``."""
        self._changes, self._change_limit = [], limit

    def take_changes(self) -> list[tuple[Node, object]] | None:
        """Edges changed since the last call: ``(node, t)``, the child of ``node`` starting
        with ``t`` added, split or removed; ``(node, None)``, ``node`` left the tree. A match
        memoised at ``node`` going on with ``t`` changes only through these. None: more than
        ``limit`` since (re-read everything)."""
        changes = self._changes
        if changes is None:
            raise RuntimeError("take_changes() without track_changes()")
        self._changes = []
        return None if len(changes) > self._change_limit else changes

    # ---- internals -----------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push(self, node: Node) -> None:
        if not node._in_heap:
            node._in_heap = True
            self._push_seq += 1
            heapq.heappush(self._heap, (node.last_access, self._push_seq, node))

    def _bump(self, node: Node | None, t: object, gone: Node | None = None) -> None:
        if node is not None:
            self._version += 1
            node.version = self._version
            changes = self._changes  # (past the limit: take_changes says None)
            if changes is not None and len(changes) <= self._change_limit:
                changes.append((node, t))
                if gone is not None:
                    changes.append((gone, None))

    def _add_leaf(self, parent: Node, key: Tokens, tick: int) -> Node:
        leaf = Node(key, parent, tick)
        parent.children[key[0]] = leaf
        self._bump(parent, key[0])  # a match that ended at `parent` may now be longer
        self._num_nodes += 1
        self._total_tokens += len(key)
        self._evictable_tokens += len(key)
        self._push(leaf)
        return leaf

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; return the new upper node.

        ``child`` keeps its identity as the lower part, so handles held by callers keep
        pointing at the same path. The upper node copies lock_ref (every lock on ``child``
        passes through it), last_access and owners, so all invariants still hold.
        """
        parent = child.parent
        upper = Node(child.key[:at], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.owners = set(child.owners)
        upper.children[child.key[at]] = child
        if child.slots is not None:
            upper.slots, child.slots = child.slots[:at], child.slots[at:]
        parent.children[upper.key[0]] = upper
        self._bump(parent, upper.key[0])  # a match ending at `parent` partly into it may grow
        child.key = child.key[at:]
        child.parent = upper
        self._num_nodes += 1
        return upper

    def _remove_leaf(self, node: Node) -> None:
        parent = node.parent
        del parent.children[node.key[0]]
        node.parent = None
        self._bump(parent, node.key[0], node)  # matches ending at `parent` into `node` shrink
        self._num_nodes -= 1
        self._total_tokens -= len(node.key)
        self._evictable_tokens -= len(node.key)
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._push(parent)

    def _path(self, node: Node) -> Tokens:
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return tuple(chain.from_iterable(reversed(keys)))

    def _check_attached(self, node: Node) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError(f"node is no longer in the tree: {node!r}")

    def check_invariants(self) -> None:
        """Raise AssertionError if the structure or a counter is inconsistent."""
        from sgl_fair.radix_check import check_tree

        check_tree(self)
