"""The router's side of SGLang's KV events: a worker's event stream as token-path operations.

``KVEventDecoder`` turns the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events of one publisher (``sgl_fair/kv_events.py`` has the wire format and the workers'
encoder) into ``TreeOp`` s for the router's global tree (``Stored``, ``Removed``,
``Cleared``), and the SGLang plugin's shadow cache uses it the same way.

This module is pure (msgspec + numpy + stdlib).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Protocol

import msgspec
import numpy as np

from sgl_fair.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    Tokens,
)
from sgl_fair.kv_hash_index import HashIndex, as_keys
from sgl_fair.radix import common_len


class Stored(msgspec.Struct, frozen=True, gc=False):
    """The worker holds all of ``path`` (and so every prefix of it)."""

    path: Tokens


class Removed(msgspec.Struct, frozen=True, gc=False):
    """The worker dropped ``path[start:]`` and everything below it (like ``Evicted``)."""

    path: Tokens
    start: int


class Cleared(msgspec.Struct, frozen=True, gc=False):
    """The worker dropped its whole cache."""


TreeOp = Stored | Removed | Cleared


class _Seg:
    """A run of consecutive pages (one chain, one page size): its tokens and hashes in flat
    arrays, no object per page. ``parent``/``poff``: the page it hangs below (None/-1 at the
    root). ``children``: page offset → segments hanging below that page (besides the next
    page of this run)."""

    __slots__ = (
        "id", "parent", "poff", "size", "n", "tokens", "hashes", "children", "alive", "marks",
        "handles",
    )  # fmt: skip

    def __init__(self, sid: int, parent: _Seg | None, poff: int, size: int) -> None:
        self.id = sid
        self.parent = parent
        self.poff = poff
        self.size = size
        self.n = 0
        self.tokens = array("i")  # widened to "q" if a token id needs it
        self.hashes = array("q")
        self.children: dict[int, list[_Seg]] | None = None
        self.alive = True
        # Pages that ended an op a follower took (ascending) and the handle it gave for each:
        # None until the first.
        self.marks: array | None = None
        self.handles: list[object] | None = None

    def page(self, i: int) -> Tokens:
        return tuple(self.tokens[i * self.size : (i + 1) * self.size])


Pos = tuple["_Seg | None", int]  # a page: (segment, offset); (None, -1) is the root


class TreeFollower(Protocol):
    """What ``KVEventDecoder.follow`` tells a tree that mirrors one worker's cache.

    ``base`` is the handle this follower returned for an earlier ``stored`` whose path runs
    through the op's point and ends ``up`` tokens below it (None: none known); ``path()``
    gives the op's whole token path instead, in O(depth), for when ``base`` cannot serve
    (the follower's tree dropped it since). See ``sgl_fair.kv_follow``.
    """

    def stored(
        self, base: object | None, up: int, tokens: Tokens, path: Callable[[], Tokens]
    ) -> object | None:
        """The worker holds ``tokens`` below the point (``path()``: root to their end).
        Returns a handle for the end of ``tokens`` (or None)."""
        ...

    def removed(self, base: object | None, up: int, path: Callable[[], tuple[Tokens, int]]) -> None:
        """The worker dropped what lies below the point towards ``base`` (``path()``:
        ``(path, start)``, as ``Removed``)."""
        ...

    def cleared(self) -> None:
        """The worker dropped its whole cache."""
        ...


class _Recorder:
    """``apply``'s follower: every op with its whole path."""

    def __init__(self) -> None:
        self.ops: list[TreeOp] = []

    def stored(self, base: object, up: int, tokens: Tokens, path: Callable[[], Tokens]) -> None:
        self.ops.append(Stored(path()))

    def removed(self, base: object, up: int, path: Callable[[], tuple[Tokens, int]]) -> None:
        self.ops.append(Removed(*path()))

    def cleared(self) -> None:
        self.ops.append(Cleared())


class KVEventDecoder:
    """One worker's event stream → ``TreeOp`` s for the router's global tree.

    Pages are kept in runs (``_Seg``: consecutive pages of one chain, stored as flat arrays)
    and found by hash through a numpy hash table (``kv_hash_index.HashIndex``), so memory has
    no Python object per page (SGLang's default page size is 1: one page per token) and a
    full GC does not walk the cache. A page's full token path is its runs' tokens from the
    root. Works for any block size, including SGLang's last, shorter page of a radix node
    (``block_size`` is per event there).

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
        self._index = HashIndex()
        self._segs: dict[int, _Seg] = {}
        self._roots: list[_Seg] = []
        self._next_id = 0
        self._num_pages = 0
        # The last path built and its page: the next event usually continues it.
        self._last: tuple[_Seg, int, Tokens] | None = None
        self.num_orphans = 0  # BlockStored events whose parent hash is unknown
        self.num_malformed = 0  # BlockStored events whose sizes do not add up
        self.num_unknown_removed = 0  # hashes in BlockRemoved never stored (or gone)
        self.num_ignored = 0  # events of another storage medium

    @property
    def num_blocks(self) -> int:
        """Pages currently known to be held."""
        return self._num_pages

    def apply(self, batch: EventBatch | Iterable[KVEvent]) -> list[TreeOp]:
        """The tree operations for one batch (or a list of events), in order, each with its
        whole path (O(depth) per op: ``follow`` is the O(new tokens) way)."""
        rec = _Recorder()
        self.follow(batch, rec)
        return rec.ops

    def follow(self, batch: EventBatch | Iterable[KVEvent], sink: TreeFollower) -> None:
        """Tell ``sink`` each tree operation of one batch as it is decoded (before the next
        event changes anything), by the handle ``sink`` gave for an earlier op through the
        same point where one is known: cost per event O(its tokens), not O(prefix depth)."""
        events = batch.events if isinstance(batch, EventBatch) else batch
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self._index.clear()
                self._segs.clear()
                self._roots.clear()
                self._num_pages = 0
                self._last = None
                sink.cleared()
                continue
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                raise TypeError(f"not a KV cache event: {ev!r}")
            if self.medium is not None and ev.medium is not None and ev.medium != self.medium:
                self.num_ignored += 1
            elif isinstance(ev, BlockStored):
                self._stored(ev, sink)
            else:
                self._removed(ev, sink)

    def drop_handles(self) -> None:
        """Forget every handle a follower gave (its tree was replaced)."""
        for seg in self._segs.values():
            seg.marks = seg.handles = None

    def leaf_paths(self) -> list[Tokens]:
        """The token path of every known page with no known child: together, every path the
        worker holds (what a follower rebuilds its tree from)."""
        return [
            self._path(s, s.n - 1)
            for s in self._segs.values()
            if not (s.children and s.children.get(s.n - 1))
        ]

    def path(self, block_hash: int) -> Tokens:
        """The token path from the root to the end of a known page (KeyError if unknown)."""
        v = int(self._index.get(as_keys([block_hash]))[0])
        if v < 0:
            raise KeyError(block_hash)
        return self._path(*self._pos(v))

    # ---- positions -----------------------------------------------------------------------

    def _pos(self, v: int) -> tuple[_Seg, int]:
        return self._segs[v >> 32], v & 0xFFFFFFFF

    @staticmethod
    def _ref(seg: _Seg | None, i: int, extra: int = 0) -> tuple[object | None, int]:
        """The handle of the nearest marked page at or below page ``(seg, i)`` in its run, and
        how many tokens its end lies below the point ``extra`` tokens above that page's end."""
        if seg is not None and seg.marks:
            k = bisect_left(seg.marks, i)
            if k < len(seg.marks):
                return seg.handles[k], (seg.marks[k] - i) * seg.size + extra  # type: ignore[index]
        return None, 0

    @staticmethod
    def _mark(seg: _Seg, i: int, handle: object) -> None:
        if seg.marks is None:
            seg.marks, seg.handles = array("i"), []
        marks, handles = seg.marks, seg.handles
        assert handles is not None
        k = bisect_left(marks, i)
        if k < len(marks) and marks[k] == i:
            handles[k] = handle
        else:
            marks.insert(k, i)
            handles.insert(k, handle)

    def _path(self, seg: _Seg | None, i: int) -> Tokens:
        if seg is None:
            return ()
        last = self._last
        if last is not None and last[0] is seg and last[1] == i:
            return last[2]
        parts = [seg.tokens[: (i + 1) * seg.size]]
        s = seg
        while s.parent is not None:
            p = s.parent
            parts.append(p.tokens[: (s.poff + 1) * p.size])
            s = p
        if len(parts) == 1:
            return tuple(parts[0])
        return tuple(chain.from_iterable(reversed(parts)))

    @staticmethod
    def _parent_pos(seg: _Seg, i: int) -> Pos:
        return (seg, i - 1) if i else (seg.parent, seg.poff)

    def _children(self, seg: _Seg | None, i: int) -> list[tuple[_Seg, int]]:
        if seg is None:
            return [(c, 0) for c in self._roots]
        out = [(seg, i + 1)] if i + 1 < seg.n else []
        if seg.children:
            out.extend((c, 0) for c in seg.children.get(i, ()))
        return out

    # ---- stores --------------------------------------------------------------------------

    def _stored(self, ev: BlockStored, sink: TreeFollower) -> None:
        hashes, token_ids, size = ev.block_hashes, ev.token_ids, ev.block_size
        if not hashes or size < 1 or len(token_ids) != size * len(hashes):
            self.num_malformed += 1
            return
        index = self._index
        parent = ev.parent_block_hash
        anchor: Pos = (None, -1)
        if parent is not None:
            v = int(index.get(as_keys([parent]))[0])
            if v < 0:
                self.num_orphans += 1
                return
            anchor = self._pos(v)
        if type(token_ids[0]) is not int:
            # EAGLE's bigram pages: (t_j, t_j+1) holds the KV of t_j, so the page's token
            # path is the pairs' first tokens (a request matching it may match one token
            # less in SGLang, whose key also needs the next token).
            tokens = tuple(pair[0] for pair in token_ids)
        else:
            tokens = tuple(token_ids)
        keys = as_keys(hashes)
        vals = index.get(keys)
        n = len(hashes)
        k = 0  # pages already known (a replay), each below the one before
        cur = anchor
        while k < n and vals[k] >= 0:
            pos = self._pos(int(vals[k]))
            pp = self._parent_pos(*pos)
            if (
                pp[0] is not cur[0]
                or pp[1] != cur[1]
                or pos[0].page(pos[1]) != tokens[k * size : (k + 1) * size]
            ):
                self.num_malformed += 1  # the hash names another path: keep the first meaning
                n = k
                break
            cur = pos
            k += 1
        m = k
        at = cur  # the last page already known: new pages hang below it
        if m < n:
            new = vals[k:n] < 0
            m = n if new.all() else k + int(np.argmin(new))
            if m > k and len(set(hashes[k:m])) < m - k:  # a hash twice in the event
                seen: set[int] = set()
                m = k
                while m < n and vals[m] < 0 and hashes[m] not in seen:
                    seen.add(hashes[m])
                    m += 1
            if m < n:
                self.num_malformed += 1
            if m > k:
                cur = self._add(cur, size, tokens[k * size : m * size], keys[k:m])
        if m:
            end_seg, end_i = cur
            assert end_seg is not None
            added = tokens[k * size : m * size]

            def path() -> Tokens:
                p = self._path(*at) + added
                self._last = (end_seg, end_i, p)
                return p

            base, up = self._ref(*at)
            handle = sink.stored(base, up, added, path)
            if handle is not None:
                self._mark(end_seg, end_i, handle)

    def _add(self, at: Pos, size: int, tokens: Tokens, keys: np.ndarray) -> tuple[_Seg, int]:
        """New pages below ``at``; returns the last one's position."""
        aseg, ai = at
        cnt = len(keys)
        if (
            aseg is not None
            and ai == aseg.n - 1
            and aseg.size == size
            and not (aseg.children and aseg.children.get(ai))
        ):
            seg, off = aseg, aseg.n  # continue the run
        else:
            seg = _Seg(self._next_id, aseg, ai, size)
            self._next_id += 1
            self._segs[seg.id] = seg
            if aseg is None:
                self._roots.append(seg)
            else:
                if aseg.children is None:
                    aseg.children = {}
                aseg.children.setdefault(ai, []).append(seg)
            off = 0
        try:
            seg.tokens.extend(tokens)
        except OverflowError:
            seg.tokens = array("q", seg.tokens)
            seg.tokens.extend(tokens)
        seg.hashes.frombytes(keys.tobytes())
        seg.n += cnt
        self._num_pages += cnt
        self._index.insert_new(keys, (seg.id << 32) | np.arange(off, off + cnt, dtype=np.int64))
        return seg, seg.n - 1

    # ---- removals ------------------------------------------------------------------------

    def _removed(self, ev: BlockRemoved, sink: TreeFollower) -> None:
        uniq = list(dict.fromkeys(ev.block_hashes))
        vals = self._index.get(as_keys(uniq)) if uniq else np.zeros(0, dtype=np.int64)
        known = [self._pos(int(v)) for v in vals if v >= 0]
        self.num_unknown_removed += len(ev.block_hashes) - len(known)
        if not known:
            return
        gone = {(s.id, i) for s, i in known}
        roots = []
        for s, i in known:
            ps, pi = self._parent_pos(s, i)
            if ps is None or (ps.id, pi) not in gone:
                roots.append((s, i))
        for s, i in roots:
            held = self._still_held(s, i, gone)
            if held < s.size:
                base, up = self._ref(s, i, s.size - held)
                sink.removed(base, up, self._path_from(s, i, held))
                continue
            # Every token of the page stays through a sibling page: EAGLE's bigram pages
            # (x, y1) and (x, y2) both hold x. What goes is below it, from each child page on
            # (its first token, y1, differs from the sibling's y2).
            for c, j in self._children(s, i):
                base, up = self._ref(c, j, c.size)
                sink.removed(base, up, self._path_from(c, j, 0))
        self._last = None
        for s, i in roots:
            self._forget(s, i)

    def _path_from(self, seg: _Seg, i: int, held: int) -> Callable[[], tuple[Tokens, int]]:
        """``(path, start)`` of page ``(seg, i)`` less its first ``held`` tokens, when asked."""

        def path() -> tuple[Tokens, int]:
            p = self._path(seg, i)
            return p, len(p) - seg.size + held

        return path

    def _still_held(self, seg: _Seg, i: int, gone: set[tuple[int, int]]) -> int:
        """Leading tokens of page ``(seg, i)`` still held through a sibling page that stays."""
        tokens = seg.page(i)
        held = 0
        for s, j in self._children(*self._parent_pos(seg, i)):
            if (s is seg and j == i) or (s.id, j) in gone or s.tokens[j * s.size] != tokens[0]:
                continue
            held = max(held, common_len(tokens, s.page(j), 0))
        return held

    def _forget(self, seg: _Seg, i: int) -> None:
        """Drop page ``(seg, i)`` and every page below it."""
        if not seg.alive or i >= seg.n:
            return  # under another root forgotten already
        dead: list[np.ndarray] = []
        stack: list[_Seg] = []
        if seg.children:
            for off in [o for o in seg.children if o >= i]:
                stack.extend(seg.children.pop(off))
        while stack:
            s = stack.pop()
            s.alive = False
            del self._segs[s.id]
            self._num_pages -= s.n
            dead.append(np.frombuffer(s.hashes, dtype=np.int64).copy())
            if s.children:
                for lst in s.children.values():
                    stack.extend(lst)
        dead.append(np.frombuffer(seg.hashes, dtype=np.int64)[i:].copy())
        if seg.marks:
            k = bisect_left(seg.marks, i)
            del seg.marks[k:]
            del seg.handles[k:]  # type: ignore[index]
        self._num_pages -= seg.n - i
        del seg.hashes[i:]
        del seg.tokens[i * seg.size :]
        seg.n = i
        if i == 0:
            seg.alive = False
            del self._segs[seg.id]
            p = seg.parent
            if p is None:
                self._roots.remove(seg)
            elif p.children:
                lst = p.children.get(seg.poff, [])
                if seg in lst:
                    lst.remove(seg)
                if not lst:
                    p.children.pop(seg.poff, None)
        self._index.delete(np.concatenate(dead))


__all__ = [
    "Cleared",
    "KVEventDecoder",
    "Removed",
    "Stored",
    "TreeFollower",
    "TreeOp",
]
