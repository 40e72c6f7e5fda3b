"""A shadow of SGLang's ``UnifiedRadixCache`` (0.5.23's default server cache), from its KV events.

``shadow.ShadowCache`` follows the plain ``RadixCache`` by wrapping its event recorder and
reading its nodes. The unified cache's tree core is Rust by default (Python as a fallback):
neither its nodes nor its recorder can be read the same way. What both cores do produce is
the KV event stream SGLang publishes for KV-aware routers (``take_events()``: ``BlockStored``
with the token ids, ``BlockRemoved``, ``AllBlocksCleared``, each tagged GPU or CPU), the
stream our router follows. ``EventShadow`` follows it too:

* it wraps the cache's ``take_events`` (on the instance): before each admission pass it
  takes the new events itself and applies their GPU ones (``sgl_fair.kv_events``'
  ``KVEventDecoder``) to its tree; the events are kept, and the next ``take_events`` call
  from SGLang's publisher returns them, so the published stream is unchanged;
* matching and memos are ``ShadowCache``'s;
* self-check: its token count must equal the cache's (``evictable_size() +
  protected_size()``). If not, the tree is rebuilt from the decoder's pages; if that does not
  match either, the shadow is dirty and the adapter uses SGLang's exact ``match_prefix``
  until it matches again.

Limits (``supported`` says why not; the adapter then keeps the exact path): KV events must be
on (the launcher turns them on: ``--kv-events-config``); any page size (above 1 the tree
keys on page tuples, as ``ShadowCache``); and requests in one namespace (events do not name
an ``extra_key``: a request with one, a ``cache_salt`` or a LoRA is matched exactly, by
SGLang; events naming a LoRA or a salt turn the shadow off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.kv_events import decode_batch
from sgl_fair.kv_follow import OwnerFollower
from sgl_fair.worker.sglang.shadow import OWNER, ShadowCache

log = logging.getLogger("sgl_fair.sglang")

DEFAULT_NS = (None, None)


def supported(tree_cache: Any) -> str | None:
    """None if ``tree_cache`` can be followed from its events, else why not."""
    if not callable(getattr(tree_cache, "take_events", None)):
        return f"{type(tree_cache).__name__} has no take_events()"
    if getattr(tree_cache, "disable", False):
        return "the radix cache is disabled"
    recorder = getattr(getattr(tree_cache, "tree_core", None), "kv_events", None)
    if not getattr(recorder, "enabled", False):
        return "KV events are off (--kv-events-config turns them on)"
    if getattr(getattr(tree_cache, "tree_core", None), "is_eagle", False):
        return "EAGLE bigram keys (SGLang's match needs the next token too)"
    return None


class EventShadow(ShadowCache):
    def __init__(self, tree_cache: Any) -> None:
        """``ShadowCache``'s state, without its recorder hooks: ``take_events`` is wrapped."""
        self._init_state(tree_cache, page=max(1, int(getattr(tree_cache, "page_size", 1) or 1)))
        self.decoder = KVEventDecoder()
        self._kept: list = []  # events taken for the shadow, not yet given to SGLang's publisher
        self._following = True
        # Events name a LoRA or a cache salt: paths of other namespaces would mix into the one
        # tree, so the shadow stops answering (the adapter matches exactly, by SGLang).
        self.namespaced = False
        self._take = tree_cache.take_events  # the cache's own (bound) method
        self._backoff = 0  # passes to wait after the last failed rebuild (doubling)
        self._follower: _Follower | None = None  # applies the decoder's ops to the tree
        self._skip = 0  # passes still to wait before the next rebuild

        def take_events() -> list:
            if self._following:
                self.sync()
            kept, self._kept = self._kept, []
            return kept + list(self._take() or ())

        tree_cache.take_events = take_events

    def detach(self) -> None:
        """Stop following: the events already taken still reach the publisher, once."""
        self._following = False
        self.trees = {}
        self._memo.clear()

    def sync(self) -> int:
        """Apply the events recorded since the last call; how many."""
        events = list(self._take() or ())
        if not events:
            return 0
        self._kept.extend(events)
        self._guard(self._apply, events)
        return len(events)

    def drain(self) -> int:
        """After a batch result (where SGLang caches what its requests computed): apply the
        events now, so the admission pass that follows finds few or none to apply — under
        SGLang's overlap schedule this runs while the GPU runs the next batch. Never raises
        into SGLang's scheduler (a failure leaves the shadow dirty: exact matches)."""
        if not self._following:
            return 0
        try:
            return self.sync()
        except Exception:  # noqa: BLE001
            if not self.dirty:
                log.exception("sgl-fair: event shadow failed; exact matches")
            self.dirty = True
            return 0

    def _apply(self, events: list) -> None:
        if any(getattr(e, "lora_id", None) is not None or getattr(e, "cache_salt", None)
               for e in events):  # fmt: skip
            if not self.namespaced:
                log.info("sgl-fair: namespaced KV events (LoRA / cache_salt); exact matches")
            self.namespaced = True
        # SGLang's event objects, read as our structs of the same wire format (its publisher
        # encodes the same way): one msgpack round trip, not a field-by-field copy.
        batch = decode_batch(msgspec.msgpack.encode([0.0, events, None]))
        tree = self._tree(DEFAULT_NS)
        if self._follower is None or self._follower.tree is not tree:
            self._follower = _Follower(self, tree)
            self.decoder.drop_handles()  # nodes of a tree since replaced (clear, rebuild)
        self.decoder.follow(batch, self._follower)

    def rebuild(self) -> None:
        """The tree again from every page the decoder knows (each known page's path)."""
        self.clear()
        self.dirty = False
        tree = self._tree(DEFAULT_NS)
        for path in self.decoder.leaf_paths():
            tree.insert(self._units(path), owner=OWNER)

    def begin_pass(self, waiting_queue: Any) -> None:
        """Before an admission pass: apply new events, self-check. Never raises into SGLang's
        scheduler: a failure leaves the shadow dirty (the adapter matches exactly)."""
        try:
            self._begin_pass()
        except Exception:  # noqa: BLE001
            if not self.dirty:
                log.exception("sgl-fair: event shadow failed; exact matches")
            self.dirty = True
            return
        self._prune_memo(waiting_queue)

    def _begin_pass(self) -> None:
        self.sync()
        if self.namespaced:
            self.dirty = True
            return
        if not self.in_sync():
            if self._skip > 0:  # a rebuild failed lately: exact matches a while longer
                self._skip -= 1
                self.dirty = True
                return
            self.num_rebuilds += 1
            self.rebuild()
            self.dirty = not self.in_sync()
            if self.dirty:  # back off: 1, 2, 4, ... passes (at most 1,024) before the next try
                self._backoff = min(1024, 2 * self._backoff or 1)
                self._skip = self._backoff
                log.info("sgl-fair: event shadow out of sync with SGLang's cache; exact matches")
            else:
                self._backoff = 0

    def handles(self, req: Any) -> bool:
        """Events name no ``extra_key``: a request with a namespace is matched exactly."""
        return req.extra_key is None and not req.cache_salt and req.lora_id is None


class _Follower(OwnerFollower):
    """The decoder's ops into the shadow's tree, by handle (``sgl_fair.kv_follow``). With
    pages of ``P > 1`` tokens the tree's edges hold page tuples (``ShadowCache._units``):
    SGLang stores and evicts whole pages, so every op is whole pages too, and a handle's
    ``up`` counts pages; an op that is not (a producer out of step) leaves the shadow dirty."""

    def __init__(self, shadow: EventShadow, tree: Any) -> None:
        super().__init__(tree, OWNER)
        self._shadow = shadow
        self._page = shadow.page

    def stored(self, base: object | None, up: int, tokens: tuple, path: Callable[[], tuple]) -> Any:
        p = self._page
        if p == 1:
            return super().stored(base, up, tokens, path)
        if len(tokens) % p or up % p:
            self._shadow.dirty = True
            return None
        units = self._shadow._units
        return super().stored(base, up // p, units(tokens), lambda: units(path()))

    def removed(self, base: object | None, up: int, path: Callable[[], tuple[tuple, int]]) -> None:
        p = self._page
        if p == 1:
            return super().removed(base, up, path)

        def paged() -> tuple[tuple, int]:
            full, start = path()
            return self._shadow._units(full), start // p  # a page sharing leading tokens
            # with a surviving sibling still goes whole: page tuples share nothing

        return super().removed(base, -(-up // p), paged)

    def cleared(self) -> None:
        self._shadow.clear()
        self.tree = self._shadow._tree(DEFAULT_NS)  # the rest of the batch goes to the new one
        self._shadow._follower = self
