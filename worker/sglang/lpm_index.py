"""The waiting requests per client in LPM order, kept across admission passes.

DLPM (and LPM) order the whole waiting queue by cached prefix length on every pass. Read from
scratch, that is a memo check per waiting request, a sort and a Python loop building each
client's queue: at ~1,000 waiting, 2.8x SGLang's own pass in a live server
(``bench/bench_sglang_live.py``; SGLang's LPM stops sorting above 128 waiting). Between two
passes few requests arrive or leave and few matches change, and both are known:

* the ledger's waiting set logs every mirror added or removed (``WaitingSet.take_touched``);
* the shadow's trees log every edge change (``RadixTree.take_changes``), and a request's
  memoised match can change only through a change at its own node, on the token it would go
  on with (``ShadowCache.watch_key``), or by its node leaving the tree.

So a pass re-reads only those requests (``sync``) and keeps, per client, a list sorted by
``(-prefix length, seq)``: exactly ``lpm_order``'s order (a stable sort on the length over
the queue in arrival order, ``seq``) restricted to that client. ``groups`` hands the lists to
the policy as the view's optional ``lpm_groups``.

The index answers only while every member is matched on the shadow; anything else (the shadow
dirty or rebuilt, a change log over its limit, a pass that did not sync) makes the next
``groups`` re-read every waiting request once. A waiting request the shadow does not handle
(a namespace its events do not name) turns the index off until that request leaves.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from typing import Any

from sgl_fair.request import ClientId, Request

Item = tuple[tuple[int, int], Request]  # ((-prefix length, seq), mirror)


class LpmIndex:
    def __init__(self) -> None:
        self._fresh = False  # False: re-read every waiting request at the next sync
        self._epoch = -1
        self._key: dict[int, tuple[int, int]] = {}  # id(mirror) -> its sort key
        self._member: dict[int, Request] = {}
        self._by_client: dict[ClientId, list[Item]] = {}
        self._watch: dict[Any, dict[Any, set[int]]] = {}  # node -> next token -> ids
        self._where: dict[int, tuple[Any, Any]] = {}  # id(mirror) -> (node, token)
        self.num_full = 0  # full re-reads (tests, bench)
        self.num_read = 0  # requests read by the last sync
        self.num_kept = 0  # syncs that read only what changed
        self.synced = True  # set by the adapter: the last pass asked for the groups
        self._blocker: Request | None = None  # a waiting request the shadow does not handle

    def drain(self, waiting: Any, shadow: Any) -> None:
        """A pass ordered without the index: drop what the logs say, and re-read everything
        at the next ``sync`` (the logs stay bounded by what changes between two passes)."""
        waiting.take_touched()
        if shadow is not None:
            shadow.take_changes()
        self._fresh = False

    def groups(
        self,
        waiting: Any,
        shadow: Any,
        length: Callable[[Request], int],
        req_of: Callable[[Request], Any],
    ) -> dict[ClientId, deque[Item]] | None:
        """Each waiting client's mirrors in LPM order, as ``(key, mirror)``, keys global (a
        merge by key is ``lpm_order``); None where the index cannot answer this pass.
        ``waiting`` is the ledger's ``WaitingSet``; ``length`` the view's ``prefix_len``."""
        blocker = self._blocker
        if blocker is not None:  # a request the shadow does not match waits: no index
            if waiting.get(id(blocker)) is blocker:  # (until it leaves: O(1) a pass)
                self.drain(waiting, shadow)
                return None
            self._blocker = None
        try:
            ok = self.sync(waiting, shadow, length, req_of)
        except BaseException:
            self._fresh = False  # half applied: read everything again next time
            raise
        if not ok:
            self._fresh = False
            return None
        return {c: deque(items) for c, items in self._by_client.items()}

    def sync(
        self,
        waiting: Any,
        shadow: Any,
        length: Callable[[Request], int],
        req_of: Callable[[Request], Any],
    ) -> bool:
        touched = waiting.take_touched()
        changes = shadow.take_changes()
        if shadow.dirty:
            return False
        if not self._fresh or changes is None or shadow.epoch != self._epoch:
            return self._full(waiting, shadow, length, req_of)
        reread: dict[int, Request] = {}
        watch = self._watch
        for node, t in changes:
            at = watch.get(node)
            if at is None:
                continue
            if t is None:  # the node left the tree: every match kept there
                del watch[node]
                for ids in at.values():
                    for key in ids:
                        reread[key] = self._member[key]
                continue
            ids = at.pop(t, None)
            if ids:
                for key in ids:
                    reread[key] = self._member[key]
                if not at:
                    del watch[node]
        for key in touched:
            m = waiting.get(key)
            if m is None:
                self._drop(key)
                reread.pop(key, None)
            else:
                reread[key] = m
        self.num_read = len(reread)
        for key, m in reread.items():
            self._drop(key)
            if waiting.get(key) is not m:  # (left unlogged: cannot happen; never kept)
                continue
            if not self._add(key, m, shadow, length, req_of):
                return False
        if len(self._member) != len(waiting):
            return False
        self.num_kept += 1
        return True

    def lengths(self) -> dict[int, int]:
        """Each member's prefix length as kept (by ``id(mirror)``; tests check it)."""
        return {key: -k[0] for key, k in self._key.items()}

    def _full(self, waiting: Any, shadow: Any, length: Callable, req_of: Callable) -> bool:
        self.num_full += 1
        self._key, self._member, self._by_client = {}, {}, {}
        self._watch, self._where = {}, {}
        self._epoch = shadow.epoch
        self._fresh = True
        ms = waiting.in_order()
        self.num_read = len(ms)
        return all(self._add(id(m), m, shadow, length, req_of) for m in ms)

    def _add(self, key: int, m: Request, shadow: Any, length: Callable, req_of: Callable) -> bool:
        req = req_of(m)
        if not shadow.handles(req):  # matched exactly by SGLang, each pass: no index
            self._blocker = m  # while it waits (not a full re-read each pass)
            return False
        n = length(m)
        where = shadow.watch_key(req)
        if where is None or shadow.dirty:  # not matched on the shadow after all
            return False
        sort_key = (-n, m.seq)
        self._key[key] = sort_key
        self._member[key] = m
        items = self._by_client.get(m.client)
        if items is None:
            self._by_client[m.client] = [(sort_key, m)]
        else:
            insort(items, (sort_key, m))  # keys are unique (seq): mirrors never compared
        self._where[key] = where
        node, t = where
        self._watch.setdefault(node, {}).setdefault(t, set()).add(key)
        return True

    def _drop(self, key: int) -> None:
        sort_key = self._key.pop(key, None)
        if sort_key is None:
            return
        m = self._member.pop(key)
        items = self._by_client[m.client]
        del items[bisect_left(items, (sort_key,))]
        if not items:
            del self._by_client[m.client]
        node, t = self._where.pop(key)
        at = self._watch.get(node)
        if at is not None:
            ids = at.get(t)
            if ids is not None:
                ids.discard(key)
                if not ids:
                    del at[t]
                    if not at:
                        del self._watch[node]
