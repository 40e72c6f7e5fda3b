"""A shadow of SGLang's prefix cache in our ``RadixTree``, for memoised prefix matches.

The adapter's cache-aware policies (DLPM, LPM) ask how much of every waiting request is
cached, on every admission pass. SGLang's own ``match_prefix`` walks its Python tree (and
splits nodes) each time: ~0.3-0.4 ms a request, ~0.4 s a pass at 1,000 waiting. The shadow
holds the same token sequences in ``sgl_fair.radix.RadixTree`` (one tree per SGLang key
namespace: ``extra_key`` and ``cache_salt`` partition SGLang's cache) and answers with
memoised matches: a request is re-matched only when its own path changed (a branch added
right where its match ends, or the tokens it matched evicted); see ``ShadowCache._match``.

**How it follows the cache.** Every change to what ``RadixCache`` holds goes through its KV
event recorder (``tree_cache.kv_events``): ``record_store(node)`` for each new leaf of
``_insert_helper`` (``insert``, ``cache_finished_req``, ``cache_unfinished_req``,
``checkpoint`` all end there), ``record_remove(node)`` for each leaf ``evict`` deletes, and
``record_all_cleared()`` in ``reset``. SGLang keeps those calls exact because external
KV-event routers depend on them, and it makes them whether or not events are enabled (the
recorder returns early when they are off). The shadow wraps the three methods on that
recorder instance (the originals still run, after ours), so it sees no event SGLang does not
report, and needs no patch of SGLang's private tree helpers. Node splits (``match_prefix``,
inserts) change no content and report nothing; the shadow does not need them.

**Self-check.** Each pass starts with an O(1) check: the shadow's token count must equal the
cache's (``evictable_size() + protected_size()``), and no update may have failed. Otherwise
the shadow is rebuilt from a walk of SGLang's tree and every memo is dropped (``epoch``), so
a mutation path we did not foresee costs one rebuild, never a stale order.

Only SGLang's plain ``RadixCache`` (exact type) is shadowed here, without EAGLE bigram keys
and not disabled; ``supported`` says why not otherwise. SGLang 0.5.23's default server tree,
``UnifiedRadixCache`` (a Rust or Python tree core, host tiers), is followed from its KV events
instead (``shadow_events.EventShadow``, which reuses this class's matching); for anything
else the adapter keeps the exact ``match_prefix`` path.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

from sgl_fair.radix import Node, RadixTree

log = logging.getLogger("sgl_fair.sglang")

OWNER = "sglang"  # the one owner of every shadow node: remove_owner prunes a subtree
Namespace = tuple[Any, Any]  # (extra_key, cache_salt)


def supported(tree_cache: Any) -> str | None:
    """None if ``tree_cache`` can be shadowed, else why not."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if type(tree_cache) is not RadixCache:
        return f"{type(tree_cache).__name__} is not SGLang's plain RadixCache"
    if getattr(tree_cache, "disable", False):
        return "the radix cache is disabled"
    if getattr(tree_cache, "is_eagle", False):
        return "EAGLE bigram keys"
    rec = getattr(tree_cache, "kv_events", None)
    if rec is None or not all(
        hasattr(rec, f) for f in ("record_store", "record_remove", "record_all_cleared")
    ):
        return "the cache has no KV event recorder"
    return None


class _Entry:
    """One waiting request's memoised match (``ShadowCache._match``)."""

    __slots__ = ("req", "num_out", "tokens", "tree", "epoch", "node", "version", "nxt", "length")

    def __init__(self, req: Any, num_out: int, tokens: tuple, tree: RadixTree, epoch: int):
        self.req = req
        self.num_out = num_out
        self.tokens = tokens
        self.tree = tree
        self.epoch = epoch
        self.node: Node | None = None  # None: not matched yet
        self.version: int | None = None  # see ShadowCache._match
        self.nxt: Any = None  # tokens[match length] (a page tuple if paged); None: all matched
        self.length = 0  # the match in tokens


class ShadowCache:
    def __init__(self, tree_cache: Any) -> None:
        self._init_state(tree_cache, page=max(1, int(getattr(tree_cache, "page_size", 1) or 1)))
        self._recorder = tree_cache.kv_events
        self._hook()
        self.rebuild()

    def _init_state(self, tree_cache: Any, *, page: int) -> None:
        """The shadow's own state (shared with ``shadow_events.EventShadow``)."""
        self.cache = tree_cache
        self.page = page
        self.trees: dict[Namespace, RadixTree] = {}
        self.epoch = 0
        self.dirty = False
        self.num_rebuilds = 0
        self.num_matches = 0  # full (non-memoised) matches, for tests and the bench
        self._memo: dict[str, _Entry] = {}

    # ---- following the cache ----------------------------------------------------------------

    def _hook(self) -> None:
        rec = self._recorder
        store, remove, cleared = rec.record_store, rec.record_remove, rec.record_all_cleared

        def record_store(node: Any, *args: Any, **kwargs: Any) -> Any:
            self._guard(self._stored, node)
            return store(node, *args, **kwargs)

        def record_remove(node: Any, *args: Any, **kwargs: Any) -> Any:
            self._guard(self._removed, node)
            return remove(node, *args, **kwargs)

        def record_all_cleared(*args: Any, **kwargs: Any) -> Any:
            self._guard(self.clear)
            return cleared(*args, **kwargs)

        rec.record_store = record_store
        rec.record_remove = record_remove
        rec.record_all_cleared = record_all_cleared

    def detach(self) -> None:
        """Stop following the cache (the recorder's own methods again)."""
        for name in ("record_store", "record_remove", "record_all_cleared"):
            self._recorder.__dict__.pop(name, None)
        self.trees = {}
        self._memo.clear()

    def _guard(self, fn: Any, *args: Any) -> None:
        # Never fail SGLang's cache operation: a failed update only forces a rebuild.
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            if not self.dirty:
                log.exception("sgl-fair: shadow cache update failed; it will be rebuilt")
            self.dirty = True

    def _path(self, node: Any) -> tuple[tuple, int]:
        """``node``'s full token path from the root, and where its own key starts in it."""
        keys = []
        root = self.cache.root_node
        while node is not None and node is not root:
            k = node.key
            keys.append(k.token_ids[: len(k)])
            node = node.parent
        if node is None:
            raise ValueError("node is not attached to the cache")
        path = array("q")
        for k in reversed(keys):
            path.extend(k)
        return tuple(path), (len(path) - len(keys[0]) if keys else 0)

    def _tree(self, ns: Namespace) -> RadixTree:
        tree = self.trees.get(ns)
        if tree is None:
            tree = self.trees[ns] = RadixTree()
            tree.track_changes()  # for take_changes (lpm_index.py); read every pass
        return tree

    def take_changes(self) -> list[tuple[Node, Any]] | None:
        """The edges changed in every tree since the last call (``RadixTree.take_changes``;
        a tree logs from its making, and trees replaced move ``epoch``); None if too many."""
        out: list[tuple[Node, Any]] = []
        for tree in self.trees.values():
            changes = tree.take_changes()
            if changes is None:
                return None
            out += changes
        return out

    def watch_key(self, req: Any) -> tuple[Node, Any] | None:
        """Where ``req``'s memoised match can change (``take_changes``' terms): its node and
        the token it would go on with. None if no memo of ``req`` holds (match it first)."""
        e = self._memo.get(req.rid)
        if e is None or e.req is not req or e.epoch != self.epoch or e.node is None:
            return None
        n = e.length // self.page
        if e.version is not None:  # inside an edge: the edge below the node
            up, depth = e.node, 0
            while up is not None:
                depth += len(up.key)
                up = up.parent
            n = depth
        return e.node, (e.tokens[n] if n < len(e.tokens) else None)

    def _stored(self, node: Any) -> None:
        path, _ = self._path(node)
        if path:
            self._tree(_ns(node.key)).insert(self._units(path), owner=OWNER)

    def _removed(self, node: Any) -> None:
        path, start = self._path(node)
        tree = self.trees.get(_ns(node.key))
        if tree is not None and len(path) > start:
            tree.remove_owner(self._units(path), OWNER, from_len=start // self.page)

    def _units(self, tokens: tuple) -> tuple:
        """What the shadow's edges hold: tokens, or with pages of ``page`` tokens, whole pages
        (SGLang then matches and stores page by page: two keys sharing half a page share
        nothing of it, so the shadow keys on page tuples, and counts pages)."""
        p = self.page
        if p == 1:
            return tokens
        return tuple(tokens[i : i + p] for i in range(0, len(tokens) - p + 1, p))

    def clear(self) -> None:
        self.trees = {}
        self.epoch += 1
        self._memo.clear()

    def rebuild(self) -> None:
        """Read the whole cache again (start, or after the self-check failed)."""
        self.clear()
        self.dirty = False
        stack = [self.cache.root_node]
        while stack:
            node = stack.pop()
            children = list(node.children.values())
            if children:
                stack.extend(children)
            elif node is not self.cache.root_node:
                self._stored(node)

    @property
    def total_tokens(self) -> int:
        return sum(t.total_tokens for t in self.trees.values()) * self.page

    def in_sync(self) -> bool:
        cache = self.cache
        return not self.dirty and self.total_tokens == (
            cache.evictable_size() + cache.protected_size()
        )

    # ---- matching -----------------------------------------------------------------------------

    def drain(self) -> int:
        """After a batch result: apply what changed since (the recorder applies SGLang's
        inserts and evictions as they happen: nothing to apply); the events applied."""
        return 0

    def begin_pass(self, waiting_queue: Any) -> None:
        """Before an admission pass: self-check (rebuild if needed), forget departed requests."""
        if not self.in_sync():
            self.num_rebuilds += 1
            log.info("sgl-fair: shadow cache out of sync with SGLang's; rebuilding it")
            self.rebuild()
        self._prune_memo(waiting_queue)

    def _prune_memo(self, waiting_queue: Any) -> None:
        """Forget the memos of requests no longer waiting (when they outnumber the queue)."""
        if len(self._memo) > 2 * len(waiting_queue) + 256:
            live = {r.rid for r in waiting_queue}
            self._memo = {rid: e for rid, e in self._memo.items() if rid in live}

    def handles(self, req: Any) -> bool:
        """Whether ``prefix_len`` answers for ``req`` (every request: namespaces are kept)."""
        return True

    def _memo_length(self, req: Any) -> int | None:
        """``req``'s memoised match length while it still holds, else None: the entry is
        this very request's at its current output length and epoch, and the tree path it
        ended on is unchanged (its node still attached, and no child where the match
        stopped, or the node's version as when matched)."""
        e = self._memo.get(req.rid)
        if e is None or e.req is not req or e.epoch != self.epoch:
            return None
        node = e.node
        if (
            e.num_out != len(req.output_ids)
            or node is None
            or (node.parent is None and node is not e.tree.root)
        ):
            return None
        version = e.version
        if version is None:
            nxt = e.nxt
            return e.length if nxt is None or nxt not in node.children else None
        return e.length if node.version == version else None

    def prefix_len(self, req: Any, input_ids: tuple) -> int:
        """``match_kv_cache(req, cache, origin_input_ids + output_ids)``'s ``prefix_len``,
        without touching SGLang's tree. ``input_ids`` is ``tuple(req.origin_input_ids)``."""
        hit = self._memo_length(req)
        if hit is not None:
            return hit
        entry = self._memo.get(req.rid)
        num_out = len(req.output_ids)
        if (
            entry is None
            or entry.req is not req
            or entry.num_out != num_out
            or entry.epoch != self.epoch
        ):
            tokens = input_ids + tuple(req.output_ids) if num_out else input_ids
            if self.page > 1:
                tokens = self._units(tokens)
            ns = (req.extra_key, req.cache_salt or None)
            entry = _Entry(req, num_out, tokens, self._tree(ns), self.epoch)
            self._memo[req.rid] = entry
        self._match(entry)
        return entry.length

    def prefix_lens(self, reqs: Sequence[Any]) -> list[int | None]:
        """``prefix_len`` of each request whose memoised match still holds, ``None`` for
        the others (to ask ``prefix_len``): an admission pass's steady state, in one loop."""
        return list(map(self._memo_length, reqs))

    def _match(self, entry: _Entry) -> None:
        """Match ``entry.tokens``; on a re-match, cut the shadow's edge where it ends.

        A memo on a node ending exactly at the match (``version`` None) stays valid while that
        node is in the tree (the match cannot shrink: eviction removes whole subtrees from the
        leaves up, so no token above the node goes first) and has no child starting with the
        next token (the only way the match can grow): splits, inserts and evictions elsewhere,
        however close, leave it alone. A match ending inside an edge is keyed, as
        ``RadixTree.memo_match`` keys it, on the version of that edge's parent, which every
        split below the parent moves (at the root of a shared document: every request of the
        document). The first match keeps that (no split: a first pass at 1,000 waiting is
        cheaper for it); a re-match splits the edge at the match, so it is keyed exactly.
        """
        tree, tokens = entry.tree, entry.tokens
        if entry.node is None:
            m = tree.match(tokens, touch=False)
            n, node = m.length, m.node
            depth, up = 0, node
            while up is not None:
                depth += len(up.key)
                up = up.parent
            entry.version = None if n == depth else node.version
        else:
            om = tree.match_owners(tokens, touch=False)
            n, node = om.length, om.node
            if n > om.node_len:  # inside an edge: split it there (no new tokens)
                node = tree.insert_matched(tokens[:n], om, owner=OWNER).node
            entry.version = None
        entry.node = node
        entry.nxt = tokens[n] if n < len(tokens) else None
        entry.length = n * self.page  # in pages if page > 1, so whole pages
        self.num_matches += 1


def _ns(key: Any) -> Namespace:
    return (key.extra_key, key.cache_salt or None)
