"""The plugin's waiting requests in arrival order, and per client, kept as they change.

An admission pass needs the waiting mirrors in arrival order (the policy's input) and, for
VTC and FairServe, grouped by client. Built from SGLang's queue on every pass, that is a sort
and a Python loop over every waiting request — about half of the plugin's pass at 1,000
waiting in a live server (``bench/bench_sglang_live.py``; SGLang's own fcfs pass does no such
work). Kept here instead as requests arrive, are admitted, retracted and leave: a pass reads
them in C (``dict.values``). Arrival order is the mirrors' ``seq`` (made in arrival order on
a monotone clock); a retracted request comes back out of order, and the next read sorts once.

Pure: no sglang import.
"""

from __future__ import annotations

from operator import attrgetter

from sgl_fair.request import ClientId, Request

_seq = attrgetter("seq")


class WaitingSet:
    """Each mirror may carry its host's object (the plugin: SGLang's ``Req``), kept in the
    same order, so a pass reads the host's queue in arrival order in C too (``hosts``)."""

    def __init__(self) -> None:
        self._all: dict[int, Request] = {}  # id(mirror) -> mirror, in arrival order
        self._host: dict[int, object] = {}  # id(mirror) -> its host object, the same order
        self._by_client: dict[ClientId, dict[int, Request]] = {}
        self._last = -1  # the largest seq added
        self._ordered = True
        self._touched: dict[int, Request] | None = None  # track(): added or removed since

    def track(self) -> None:
        """Log every mirror added or removed from now on, for ``take_touched``."""
        if self._touched is None:
            self._touched = {}

    def untrack(self) -> None:
        self._touched = None

    def take_touched(self) -> dict[int, Request]:
        """The mirrors (by id) added or removed since the last call; those waiting now are
        in ``get``. Only after ``track``."""
        touched = self._touched
        if touched is None:
            raise RuntimeError("take_touched() without track()")
        self._touched = {}
        return touched

    def get(self, key: int) -> Request | None:
        """The waiting mirror ``m`` with ``id(m) == key``, or None."""
        return self._all.get(key)

    def __len__(self) -> int:
        return len(self._all)

    def add(self, m: Request, host: object = None) -> None:
        key = id(m)
        if key in self._all:
            return
        if self._touched is not None:
            self._touched[key] = m
        self._all[key] = m
        self._host[key] = host
        group = self._by_client.get(m.client)
        if group is None:
            self._by_client[m.client] = {key: m}
        else:
            group[key] = m
        if m.seq < self._last:
            self._ordered = False  # a retracted request, back among later arrivals
        else:
            self._last = m.seq

    def remove(self, m: Request) -> None:
        key = id(m)
        if self._all.pop(key, None) is None:
            return
        if self._touched is not None:
            self._touched[key] = m
        del self._host[key]
        group = self._by_client[m.client]
        del group[key]
        if not group:
            del self._by_client[m.client]

    def _sort(self) -> None:
        if self._ordered:
            return
        ordered = sorted(self._all.values(), key=_seq)
        self._all = {id(m): m for m in ordered}
        host = self._host
        self._host = {id(m): host[id(m)] for m in ordered}
        self._by_client = {}
        for m in ordered:
            self._by_client.setdefault(m.client, {})[id(m)] = m
        self._ordered = True

    def in_order(self) -> list[Request]:
        """Every waiting mirror, earliest arrival first."""
        self._sort()
        return list(self._all.values())

    def hosts(self) -> list[object]:
        """Every waiting mirror's host object, in ``in_order()``'s order."""
        self._sort()
        return list(self._host.values())

    def earliest(self) -> dict[ClientId, Request]:
        """Each waiting client's earliest waiting mirror."""
        self._sort()
        return {c: next(iter(g.values())) for c, g in self._by_client.items()}

    def groups(self) -> dict[ClientId, list[Request]]:
        """``group_by_client(in_order())``, from the groups kept."""
        self._sort()
        return {c: list(g.values()) for c, g in self._by_client.items()}
