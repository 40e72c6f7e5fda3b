"""FairServe's waiting queue, kept incrementally, so one admission pass costs
O(admitted · log users) instead of O(waiting).

``fairserve.FairServe.order`` picks, at every pull, the user with the smallest
``(counter, arrival key of the user's earliest candidate, user)`` — first among the calls
that continue an in-flight interaction, then among all waiting calls. Rebuilding those
groups from the scheduler's queue costs O(waiting) per pass while a pass admits a few
dozen; this index keeps them between passes instead:

* ``queues[user]``: the user's waiting requests, in arrival-key order (the scheduler's
  order: its queue is sorted by arrival key, retracted requests re-inserted by key);
* ``by_iid[interaction]``: its waiting requests; ``cont_iids``: the interactions whose
  calls currently *continue* (FairServe's ``_continues`` at the last refresh), and
  ``cont[user]``: the user's waiting requests of those interactions, in arrival-key order;
* ``heap_all`` / ``heap_cont``: lazy min-heaps of ``(counter, head key, user)``. Every change
  of a user's counter or of a list head pushes a fresh entry; an entry is *valid* while it
  equals the user's current state, stale ones are dropped when they reach the top (and the
  heap is rebuilt when stale entries outnumber the users). Counters never fall during a
  pass (charges are >= 0), so the valid top is the exact argmin.

Whether an interaction continues depends on the clock (an idle interaction ends after a
timeout) and on the policy's bookkeeping. It is recomputed at the start of a pass
(``refresh``) only for interactions *marked* since (the policy marks an interaction when its
last-activity time or its started flag changes) and for those whose deadline (last activity
+ timeout) has passed, from a heap of deadlines; if the clock went backwards, all of them.
As in the per-pass rebuild, the continuing set is fixed for the whole pass.

The index mirrors the policy's hooks (arrival, admission, retraction, abort), which is
exactly the scheduler's queue. ``matches`` is the O(1) check the policy makes before using
it (length and both ends of the ``waiting`` it was given); on a mismatch — a host that
passes part of its queue, e.g. the SGLang adapter's restarted walk — the policy takes the
reference path (the per-pass rebuild, ``reference_walk``). So does a pass whose walk is
resumed without the yielded request having been admitted. ``check`` verifies the whole
index (``FairServe.check_invariants``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from sgl_fair.request import ClientId, Request

Entry = tuple[float, tuple[float, int], ClientId]
_key = Request.arrival_key


def reference_walk(
    phases: Sequence[Mapping[ClientId, deque[Request]]],
    taken: set[int],
    counter: Callable[[ClientId], float],
) -> Iterator[Request]:
    """The per-pass selection over prebuilt per-user queues (the original ``order``):
    per phase, the least-served user's earliest request not in ``taken``, counters re-read
    after every admission. Every yielded request is added to ``taken``."""
    heaps = [[(counter(u), q[0].arrival_key(), u) for u, q in qs.items() if q] for qs in phases]
    for heap in heaps:
        heapq.heapify(heap)
    for heap, qs in zip(heaps, phases, strict=True):
        while heap:
            c, key, u = heapq.heappop(heap)
            q = qs[u]
            while q and id(q[0]) in taken:
                q.popleft()
            if not q:
                continue
            fresh = (counter(u), q[0].arrival_key())
            if fresh != (c, key):  # stale entry: charged, or its head was taken
                heapq.heappush(heap, (*fresh, u))
                continue
            req = q.popleft()
            taken.add(id(req))
            yield req  # resumed only if admitted (and charged)
            if q:
                heapq.heappush(heap, (counter(u), q[0].arrival_key(), u))


def _index_of(lst: list[Request], req: Request) -> int:
    if lst and lst[0] is req:
        return 0
    i = bisect_left(lst, req.arrival_key(), key=_key)
    while i < len(lst) and lst[i] is not req:
        i += 1
    if i == len(lst):
        raise AssertionError(f"fairserve index: {req!r} missing from its list")
    return i


class WaitingIndex:
    """The waiting requests by user and by interaction, with lazy heaps (module docstring)."""

    def __init__(self, counter: Callable[[ClientId], float]) -> None:
        self.counter = counter
        self.tracked: dict[int, Request] = {}
        self.queues: dict[ClientId, list[Request]] = {}
        self.by_iid: dict[str, list[Request]] = {}
        self.cont: dict[ClientId, list[Request]] = {}
        self.cont_iids: set[str] = set()
        self.heap_all: list[Entry] = []
        self.heap_cont: list[Entry] = []
        self.marked: set[str] = set()  # interactions to re-check at the next refresh
        self.deadlines: list[tuple[float, str]] = []
        self.refreshed_at = float("-inf")

    def __len__(self) -> int:
        return len(self.tracked)

    def matches(self, waiting: Sequence[Request]) -> bool:
        """O(1): ``waiting`` has as many requests as the index, and its ends are indexed."""
        if len(waiting) != len(self.tracked):
            return False
        if not waiting:
            return True
        first, last = waiting[0], waiting[-1]
        return self.tracked.get(id(first)) is first and self.tracked.get(id(last)) is last

    # ---------------------------------------------------------------- membership

    def add(self, req: Request) -> None:
        self.tracked[id(req)] = req
        u = req.client
        q = self.queues.get(u)
        if q is None:
            self.queues[u] = [req]
            self._push(self.heap_all, self.queues, u)
        else:
            head = q[0]
            if req.arrival_key() >= q[-1].arrival_key():
                q.append(req)
            else:
                insort_right(q, req, key=_key)
            if q[0] is not head:
                self._push(self.heap_all, self.queues, u)
        iid = req.interaction_id
        if iid is None:
            return
        self.by_iid.setdefault(iid, []).append(req)
        self.marked.add(iid)
        if iid in self.cont_iids:
            self._cont_add(req)

    def remove(self, req: Request) -> bool:
        """Forget ``req`` (admitted or aborted); False if it was not indexed."""
        if self.tracked.pop(id(req), None) is None:
            return False
        u = req.client
        q = self.queues[u]
        i = _index_of(q, req)
        del q[i]
        if not q:
            del self.queues[u]
        elif i == 0:
            self._push(self.heap_all, self.queues, u)
        iid = req.interaction_id
        if iid is None:
            return True
        reqs = self.by_iid[iid]
        reqs.remove(req)  # Request compares by identity (eq=False)
        if iid in self.cont_iids:
            self._cont_remove(req)
        if not reqs:
            del self.by_iid[iid]
            self.cont_iids.discard(iid)
            self.marked.discard(iid)
        return True

    def touch(self, user: ClientId) -> None:
        """``user``'s counter changed: fresh heap entries."""
        if user in self.queues:
            self._push(self.heap_all, self.queues, user)
        if user in self.cont:
            self._push(self.heap_cont, self.cont, user)

    def mark(self, iid: str | None) -> None:
        """``iid``'s continuing status may have changed: re-check it at the next refresh."""
        if iid is not None and iid in self.by_iid:
            self.marked.add(iid)

    def mark_all(self) -> None:
        self.marked.update(self.by_iid)

    def _cont_add(self, req: Request) -> None:
        u = req.client
        q = self.cont.get(u)
        if q is None:
            self.cont[u] = [req]
        else:
            head = q[0]
            insort_right(q, req, key=_key)
            if q[0] is head:
                return
        self._push(self.heap_cont, self.cont, u)

    def _cont_remove(self, req: Request) -> None:
        u = req.client
        q = self.cont[u]
        i = _index_of(q, req)
        del q[i]
        if not q:
            del self.cont[u]
        elif i == 0:
            self._push(self.heap_cont, self.cont, u)

    # ---------------------------------------------------------------- heaps

    def _push(self, heap: list[Entry], lists: dict[ClientId, list[Request]], u: ClientId) -> None:
        heapq.heappush(heap, (self.counter(u), lists[u][0].arrival_key(), u))
        if len(heap) > 3 * len(lists) + 64:  # mostly stale: rebuild in place
            heap[:] = [(self.counter(v), q[0].arrival_key(), v) for v, q in lists.items()]
            heapq.heapify(heap)

    def _valid(self, entry: Entry, lists: dict[ClientId, list[Request]]) -> bool:
        q = lists.get(entry[2])
        return (
            q is not None and entry[0] == self.counter(entry[2]) and entry[1] == q[0].arrival_key()
        )

    def top(self, heap: list[Entry], lists: dict[ClientId, list[Request]]) -> ClientId | None:
        """The user with the smallest valid entry (stale entries on top are dropped)."""
        while heap:
            if self._valid(heap[0], lists):
                return heap[0][2]
            heapq.heappop(heap)
        return None

    def min_counter(self) -> float | None:
        """The smallest counter among users with a waiting request (None: none waits)."""
        u = self.top(self.heap_all, self.queues)
        return None if u is None else self.counter(u)

    # ---------------------------------------------------------------- continuing calls

    def refresh(
        self,
        now: float,
        continues: Callable[[str, float], bool],
        deadline: Callable[[str], float],
    ) -> None:
        """Bring ``cont_iids`` up to date at ``now`` (see the module docstring)."""
        if now < self.refreshed_at:
            self.mark_all()
        self.refreshed_at = now
        marked = self.marked
        heap = self.deadlines
        horizon = now + 1e-6 + abs(now) * 1e-12  # float slack: re-checked exactly below
        while heap and heap[0][0] <= horizon:
            iid = heapq.heappop(heap)[1]
            if iid in self.cont_iids:
                marked.add(iid)
        for iid in marked:
            reqs = self.by_iid.get(iid)
            new = reqs is not None and continues(iid, now)
            if new:
                heapq.heappush(heap, (deadline(iid), iid))
            if new == (iid in self.cont_iids):
                continue
            if new:
                self.cont_iids.add(iid)
                for req in reqs:
                    self._cont_add(req)
            else:
                self.cont_iids.discard(iid)
                for req in reqs or ():
                    self._cont_remove(req)
        marked.clear()
        if len(heap) > 4 * len(self.cont_iids) + 1024:
            heap[:] = [(deadline(i), i) for i in self.cont_iids]
            heapq.heapify(heap)

    # ---------------------------------------------------------------- the walk

    def walk(self, first: Mapping[ClientId, deque[Request]] | None) -> Iterator[Request]:
        """One pass: ``first`` (a per-pass phase, FairServe's ``"running"`` mode), else the
        indexed continuing calls, then every waiting call; each phase the least-served
        user's earliest request. Falls back to ``reference_walk`` if a yielded request is
        not admitted before the walk resumes."""
        taken: set[int] = set()
        if first is not None:
            yield from reference_walk([first], taken, self.counter)
            if any(i in self.tracked for i in taken):
                yield from reference_walk([self._snapshot(self.queues)], taken, self.counter)
                return
            phases = [(self.heap_all, self.queues)]
        else:
            phases = [(self.heap_cont, self.cont), (self.heap_all, self.queues)]
        for n, (heap, lists) in enumerate(phases):
            while (u := self.top(heap, lists)) is not None:
                req = lists[u][0]
                taken.add(id(req))
                yield req
                if id(req) in self.tracked:  # resumed without an admission
                    rest = [self._snapshot(ls) for _, ls in phases[n:]]
                    yield from reference_walk(rest, taken, self.counter)
                    return

    @staticmethod
    def _snapshot(lists: Mapping[ClientId, Iterable[Request]]) -> dict[ClientId, deque[Request]]:
        return {u: deque(q) for u, q in lists.items()}

    # ---------------------------------------------------------------- checks

    def check(self, continues: Callable[[str], bool] | None = None) -> None:
        """The index is self-consistent (and, given ``continues``, its continuing set too)."""
        by_user: dict[ClientId, list[Request]] = {}
        for req in self.tracked.values():
            by_user.setdefault(req.client, []).append(req)
        assert by_user.keys() == self.queues.keys(), "fairserve index: users differ"
        for u, q in self.queues.items():
            assert sorted(map(id, q)) == sorted(map(id, by_user[u])), f"queue of {u!r}"
            assert all(_key(a) <= _key(b) for a, b in zip(q, q[1:], strict=False)), (
                f"{u!r} unsorted"
            )
        iids: dict[str, list[int]] = {}
        for req in self.tracked.values():
            if req.interaction_id is not None:
                iids.setdefault(req.interaction_id, []).append(id(req))
        assert {i: sorted(v) for i, v in iids.items()} == {
            i: sorted(map(id, v)) for i, v in self.by_iid.items()
        }, "fairserve index: interactions differ"
        assert self.cont_iids <= self.by_iid.keys()
        want = sorted(id(r) for i in self.cont_iids for r in self.by_iid[i])
        assert want == sorted(id(r) for q in self.cont.values() for r in q), "continuing"
        assert all(q for q in self.cont.values()) and all(q for q in self.queues.values())
        for heap, lists in ((self.heap_all, self.queues), (self.heap_cont, self.cont)):
            valid = {e[2] for e in heap if self._valid(e, lists)}
            assert valid == lists.keys(), "fairserve index: a user has no valid heap entry"
        if continues is not None and not self.marked:
            assert self.cont_iids == {i for i in self.by_iid if continues(i)}, "stale status"
