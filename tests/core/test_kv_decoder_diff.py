"""Differential test: the array-backed ``KVEventDecoder`` against the one it replaced.

``OldDecoder`` below is the decoder before issue 39 (one ``_Block`` object per page, verbatim
but for its name), kept only here as the reference. Random event streams (page sizes 1-3,
mid-chain parents, EAGLE bigram pages, unknown and repeated hashes, hash collisions, other
media, clears) must give both the same ops, counters and follower-tree contents.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable
from itertools import chain

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_fair.kv_decoder import Cleared, KVEventDecoder, Removed, Stored, TreeOp
from sgl_fair.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    Tokens,
)
from sgl_fair.radix import RadixTree, common_len

Children = list[tuple[Tokens, int]]  # sibling pages as (tokens, hash), sorted


class _Block:
    """One known page: its parent page's hash (None at the root) and its own tokens.

    ``children`` is None, one hash, or a sorted list of ``(tokens, hash)``: most pages
    have at most one child (a chain; page size 1 means one block per token), so the
    common case costs no list. Sorting lets a removal find, in O(log n), the surviving
    sibling sharing the most leading tokens (it is adjacent in sorted order).
    """

    __slots__ = ("parent", "tokens", "children")

    def __init__(self, parent: int | None, tokens: Tokens) -> None:
        self.parent = parent
        self.tokens = tokens
        self.children: int | Children | None = None


class OldDecoder:
    """The decoder before issue 39 (one object per page), kept as the reference.

    Keeps ``hash → (parent hash, page tokens)`` and rebuilds a page's full token path by
    walking its parents, so memory stays linear in the tokens cached (storing each page's
    whole path would be quadratic at page size 1, SGLang's default). Works for any block
    size, including SGLang's last, shorter page of a radix node (``block_size`` is per
    event there).

    Removals are token-exact: sibling pages (same parent) may share leading tokens — the
    page ``(5, 0, 0, 0)`` goes while ``(5, 1, 0, 0)`` stays — and the router's tree is a
    token tree, so a ``Removed`` starts where the page leaves every surviving sibling, not
    at the page's start (which would drop the sibling's claim too).

    Never raises on a well-typed but inconsistent stream (late join, lost messages, a
    buggy producer): what cannot be placed is skipped and counted.

    ``medium``: only events of that storage medium are followed (SGLang's hierarchical
    cache also publishes host-memory tiers, with the same hashes); events with no medium
    count as it. None follows every event.
    """

    def __init__(self, *, medium: str | None = MEDIUM_GPU) -> None:
        self.medium = medium
        self._blocks: dict[int, _Block] = {}
        self._roots: Children = []  # pages whose parent is the root
        # The last path built and the hash of its last page: the next event of a step
        # usually continues it (SGLang splits a node's chain when the last page is short).
        self._last: tuple[int, Tokens] | None = None
        self.num_orphans = 0  # BlockStored events whose parent hash is unknown
        self.num_malformed = 0  # BlockStored events whose sizes do not add up
        self.num_unknown_removed = 0  # hashes in BlockRemoved never stored (or gone)
        self.num_ignored = 0  # events of another storage medium

    @property
    def num_blocks(self) -> int:
        """Pages currently known to be held."""
        return len(self._blocks)

    def apply(self, batch: EventBatch | Iterable[KVEvent]) -> list[TreeOp]:
        """The tree operations for one batch (or a list of events), in order."""
        events = batch.events if isinstance(batch, EventBatch) else batch
        ops: list[TreeOp] = []
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self._blocks.clear()
                self._roots.clear()
                self._last = None
                ops.append(Cleared())
                continue
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                raise TypeError(f"not a KV cache event: {ev!r}")
            if self.medium is not None and ev.medium is not None and ev.medium != self.medium:
                self.num_ignored += 1
            elif isinstance(ev, BlockStored):
                self._stored(ev, ops)
            else:
                self._removed(ev, ops)
        return ops

    def leaf_paths(self) -> list[Tokens]:
        """The token path of every known page with no known child: together, every path the
        worker holds (what a follower rebuilds its tree from)."""
        return [self.path(h) for h, block in self._blocks.items() if not block.children]

    def path(self, block_hash: int) -> Tokens:
        """The token path from the root to the end of a known page (KeyError if unknown)."""
        last = self._last
        if last is not None and last[0] == block_hash:
            return last[1]
        blocks = self._blocks
        parts = []
        h: int | None = block_hash
        while h is not None:
            block = blocks[h]
            parts.append(block.tokens)
            h = block.parent
        return tuple(chain.from_iterable(reversed(parts)))

    # ---- stores --------------------------------------------------------------------------

    def _stored(self, ev: BlockStored, ops: list[TreeOp]) -> None:
        hashes, token_ids, size = ev.block_hashes, ev.token_ids, ev.block_size
        if not hashes or size < 1 or len(token_ids) != size * len(hashes):
            self.num_malformed += 1
            return
        blocks = self._blocks
        parent = ev.parent_block_hash
        if parent is None:
            prefix: Tokens = ()
        elif parent in blocks:
            prefix = self.path(parent)
        else:
            self.num_orphans += 1
            return
        if type(token_ids[0]) is not int:
            # EAGLE's bigram pages: (t_j, t_j+1) holds the KV of t_j, so the page's token
            # path is the pairs' first tokens (a request matching it may match one token
            # less in SGLang, whose key also needs the next token).
            tokens = tuple(pair[0] for pair in token_ids)
        else:
            tokens = tuple(token_ids)
        end = 0
        # The block new pages hang below (None at the root): within an event it is the
        # page just added, whose child slot is empty, so linking is one assignment.
        above = blocks[parent] if parent is not None else None
        for i, h in enumerate(hashes):
            page = tokens[i * size : (i + 1) * size]
            known = blocks.get(h)
            if known is None:
                block = blocks[h] = _Block(parent, page)
                if above is not None and above.children is None:
                    above.children = h
                else:
                    self._link(parent, h, page)
                above = block
            elif known.parent != parent or known.tokens != page:
                # The hash names another path (a collision, or a producer out of step):
                # keep the first meaning; what follows in this event cannot be placed.
                self.num_malformed += 1
                break
            else:  # stored twice (store once is the protocol, but a replay may repeat)
                above = known
            parent = h
            end = (i + 1) * size
        if end:
            path = prefix + tokens[:end]
            self._last = (hashes[end // size - 1], path)
            ops.append(Stored(path))

    def _siblings(self, parent: int | None) -> Children | None:
        """The sorted child list of ``parent`` (the root's if None), or None if it has <2."""
        if parent is None:
            return self._roots
        block = self._blocks.get(parent)
        if block is None or not isinstance(block.children, list):
            return None
        return block.children

    def _link(self, parent: int | None, h: int, tokens: Tokens) -> None:
        if parent is None:
            insort(self._roots, (tokens, h))
            return
        block = self._blocks[parent]
        c = block.children
        if c is None:
            block.children = h
        elif isinstance(c, list):
            insort(c, (tokens, h))
        else:
            block.children = sorted([(self._blocks[c].tokens, c), (tokens, h)])

    def _unlink(self, parent: int | None, h: int, tokens: Tokens) -> None:
        if parent is not None:
            block = self._blocks.get(parent)
            if block is None:
                return
            if not isinstance(block.children, list):
                if block.children == h:
                    block.children = None
                return
        siblings = self._siblings(parent)
        assert siblings is not None
        i = bisect_left(siblings, (tokens, h))
        if i < len(siblings) and siblings[i][1] == h:
            del siblings[i]

    # ---- removals ------------------------------------------------------------------------

    def _removed(self, ev: BlockRemoved, ops: list[TreeOp]) -> None:
        blocks = self._blocks
        known = [h for h in dict.fromkeys(ev.block_hashes) if h in blocks]
        self.num_unknown_removed += len(ev.block_hashes) - len(known)
        if not known:
            return
        gone = set(known)
        # A page whose parent goes in the same event is covered by its parent's removal.
        roots = [h for h in known if blocks[h].parent not in gone]
        for h in roots:
            path = self.path(h)
            start = len(path) - len(blocks[h].tokens) + self._still_held(h, gone)
            if start < len(path):
                ops.append(Removed(path, start))
                continue
            # Every token of the page stays through a sibling page: EAGLE's bigram pages
            # (x, y1) and (x, y2) both hold x. What goes is below it, from each child page on
            # (its first token, y1, differs from the sibling's y2).
            for child in _child_hashes(blocks[h]):
                ops.append(Removed(self.path(child), len(path)))
        self._last = None
        for h in roots:
            self._forget(h)

    def _still_held(self, h: int, gone: set[int]) -> int:
        """Leading tokens of page ``h`` still held through a sibling page that stays."""
        block = self._blocks[h]
        siblings = self._siblings(block.parent)
        if not siblings:
            return 0
        tokens = block.tokens
        i = bisect_left(siblings, (tokens, h))
        held = 0
        j = i - 1  # the nearest surviving sibling on each side shares the most tokens
        while j >= 0 and siblings[j][1] in gone:
            j -= 1
        if j >= 0:
            held = common_len(tokens, siblings[j][0], 0)
        j = i + 1 if i < len(siblings) and siblings[i][1] == h else i
        while j < len(siblings) and siblings[j][1] in gone:
            j += 1
        if j < len(siblings):
            held = max(held, common_len(tokens, siblings[j][0], 0))
        return held

    def _forget(self, root: int) -> None:
        """Drop ``root`` and every page below it."""
        blocks = self._blocks
        block = blocks.get(root)
        if block is None:
            return  # under another root forgotten already
        self._unlink(block.parent, root, block.tokens)
        stack = [root]
        while stack:
            block = blocks.pop(stack.pop(), None)
            if block is None:
                continue
            c = block.children
            if isinstance(c, list):
                stack.extend(h for _, h in c)
            elif c is not None:
                stack.append(c)


def _child_hashes(block: _Block) -> list[int]:
    c = block.children
    if c is None:
        return []
    return [h for _, h in c] if isinstance(c, list) else [c]


# ---- the test -------------------------------------------------------------------------------

BIG = [2**63 - 1, 2**64 - 1, -(2**63), 2**63 + 5]  # int64 extremes and unsigned 64-bit


@st.composite
def streams(draw) -> list[list[KVEvent]]:
    """Batches of events that mostly make sense (stores below known pages), with noise."""
    fresh = iter(range(1_000, 10**6))
    known: list[int] = []  # hashes stored so far (some maybe gone: that is noise too)
    batches: list[list[KVEvent]] = []
    for _ in range(draw(st.integers(1, 8))):
        batch: list[KVEvent] = []
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(["store"] * 6 + ["remove"] * 3 + ["clear"]))
            medium = draw(st.sampled_from([None, None, None, MEDIUM_GPU, "CPU"]))
            if kind == "clear":
                batch.append(AllBlocksCleared())
                continue
            if kind == "remove":
                pool = known + [7, BIG[1]]
                hs = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5))
                batch.append(BlockRemoved(hs, medium=medium))
                continue
            size = draw(st.sampled_from([1, 1, 2, 3]))
            n = draw(st.integers(1, 4))
            parent = draw(st.sampled_from([None, 3] + known[-6:] + known[:3] or [None]))
            hs = []
            for _ in range(n):
                r = draw(st.integers(0, 9))
                if r == 0 and known:
                    hs.append(draw(st.sampled_from(known)))  # a replay or a collision
                elif r == 1:
                    hs.append(draw(st.sampled_from(BIG)))
                else:
                    hs.append(next(fresh))
            toks: list = draw(st.lists(st.integers(0, 2), min_size=n * size, max_size=n * size))
            if draw(st.integers(0, 5)) == 0:  # EAGLE bigram pages
                toks = [(t, draw(st.integers(0, 2))) for t in toks]
            if draw(st.integers(0, 15)) == 0:
                toks = toks[:-1]  # sizes that do not add up
            batch.append(BlockStored(hs, parent, toks, size, None, medium=medium))
            known.extend(hs)
        batches.append(batch)
    return batches


def follow(tree: RadixTree, ops: list[TreeOp]) -> None:
    for op in ops:
        if isinstance(op, Stored):
            tree.insert(op.path, owner=0)
        elif isinstance(op, Removed):
            tree.remove_owner(op.path, 0, from_len=op.start)
        elif isinstance(op, Cleared):
            tree.remove_owner((), 0)
            for child in list(tree.root.children.values()):
                tree.remove_owner(child.key[:1], 0)


def contents(tree: RadixTree) -> set[tuple[int, ...]]:
    out, stack = set(), [((), tree.root)]
    while stack:
        path, node = stack.pop()
        if not node.children and node is not tree.root:
            out.add(path)
        stack.extend((path + c.key, c) for c in node.children.values())
    return out


def counters(dec) -> tuple[int, ...]:
    return (
        dec.num_blocks,
        dec.num_orphans,
        dec.num_malformed,
        dec.num_unknown_removed,
        dec.num_ignored,
    )


def check_same(batches: list[list[KVEvent]]) -> None:
    old, new = OldDecoder(), KVEventDecoder()
    t_old, t_new = RadixTree(), RadixTree()
    for batch in batches:
        ops_old, ops_new = old.apply(batch), new.apply(batch)
        stored_old = [op for op in ops_old if not isinstance(op, Removed)]
        stored_new = [op for op in ops_new if not isinstance(op, Removed)]
        assert stored_new == stored_old
        assert Counter(op for op in ops_new if isinstance(op, Removed)) == Counter(
            op for op in ops_old if isinstance(op, Removed)
        )
        follow(t_old, ops_old)
        follow(t_new, ops_new)
        assert contents(t_new) == contents(t_old)
        assert counters(new) == counters(old)
        assert sorted(new.leaf_paths()) == sorted(old.leaf_paths())
        for h in list(old._blocks)[:20]:
            assert new.path(h) == old.path(h)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_same_as_the_old_decoder(batches):
    check_same(batches)


def test_mid_chain_parent_and_sibling_removal():
    """A node split in SGLang: a child below a mid-chain hash, then removals around it."""
    batches = [
        [BlockStored([1, 2, 3, 4], None, [5, 6, 7, 8], 1, None)],
        [BlockStored([10, 11], 2, [7, 9], 1, None)],  # shares token 7 with page 3
        [BlockRemoved([3, 4])],  # page 3 goes, but 7 stays through 10
        [BlockRemoved([10])],
        [BlockStored([3, 4], 2, [7, 8], 1, None), BlockStored([4, 20], 3, [8, 1], 1, None)],
    ]
    check_same(batches)
