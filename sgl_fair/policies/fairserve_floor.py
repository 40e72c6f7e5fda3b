"""FairServe's counter-lift floor over *settled* service, and forgetting idle users.

``charge="admission"`` pre-charges a call's expected output at admission and settles it at
finish (a refund when the output was shorter). The lift must not read those pre-charges: a
newcomer lifted onto user A's pre-charged counter would then sit above A once A's refund
lands, leaving A credit below the very floor its own pre-charge set (issue 31). So the
floor is taken over **settled** counters — a user's counter less the expected output it
was pre-charged for calls not yet settled (input parts are final when charged):

    floor = min{ settled(u) : u has a waiting call }, or settled(last leaver) if none waits

Settled counters never fall (a settlement adds the call's true cost less its input part,
>= 0), so a user backlogged when a floor is issued stays at or above it, a user who
(re)joins later is lifted to a later floor, and the floor itself never falls over time.

That monotone floor makes forgetting exact: a user with nothing queued or running (nothing
left to settle) whose counter is at or below the current floor would, whenever it comes
back, be lifted to a floor at least as high — the same value a forgotten user (counter 0)
is lifted to. Such users are dropped (``forget``, and an amortized sweep of all), so
the counters held are bounded by the users queued or running, plus the idle ones still
above the floor. The last leaver is kept: with an empty queue its counter is the floor.

``Floors`` keeps a lazy min-heap of ``(settled, user)`` over the users with a waiting call
(an entry is valid while the user waits and its value is current), O(log users) per change.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from sgl_fair.policies.base import ActiveClients
from sgl_fair.request import ClientId


class Floors:
    def __init__(self, counters: dict[ClientId, float], active: ActiveClients) -> None:
        self.counters = counters  # the policy's (pre-charges included), shared
        self.active = active
        self.pending: dict[ClientId, float] = {}  # pre-charged expected output, unsettled
        self.running: dict[ClientId, int] = {}  # admitted calls not yet finished
        self._heap: list[tuple[float, ClientId]] = []
        self.sweep_min = self._sweep_at = 1024  # sweep past it (then 2x, amortized)
        self.num_forgotten = 0

    def settled(self, user: ClientId) -> float:
        return self.counters.get(user, 0.0) - self.pending.get(user, 0.0)

    def touch(self, user: ClientId) -> None:
        """``user``'s counter, pending charge or waiting status changed."""
        if self.active.is_active(user):
            heapq.heappush(self._heap, (self.settled(user), user))
            if len(self._heap) > 3 * len(self.active) + 64:  # mostly stale: rebuild
                self._heap = [(self.settled(u), u) for u in self.active.clients()]
                heapq.heapify(self._heap)

    def floor(self) -> float:
        """The floor a (re)joining user is lifted to (module docstring)."""
        heap = self._heap
        while heap:
            value, user = heap[0]
            if self.active.is_active(user) and value == self.settled(user):
                return value
            heapq.heappop(heap)
        if len(self.active):  # not reached while every change is touched; exact anyway
            return min(self.settled(u) for u in self.active.clients())
        last = self.active.last_left
        return self.settled(last) if last is not None else 0.0

    # ---- calls ------------------------------------------------------------------------------

    def admitted(self, user: ClientId, pending: float) -> None:
        """A call of ``user`` was admitted (first time), ``pending`` of its charge unsettled;
        call before the counter changes (``touch`` follows the counter's writer)."""
        self.running[user] = self.running.get(user, 0) + 1
        if pending:
            self.pending[user] = self.pending.get(user, 0.0) + pending

    def settled_call(self, user: ClientId, pending: float) -> None:
        """A call of ``user`` ended; ``pending`` of it was unsettled until now."""
        n = self.running.get(user, 0) - 1
        if n > 0:
            self.running[user] = n
            if pending:
                self.pending[user] = self.pending.get(user, 0.0) - pending
        else:  # no call left to settle: exactly 0 (no float residue)
            self.running.pop(user, None)
            self.pending.pop(user, None)

    # ---- forgetting -------------------------------------------------------------------------

    def forgettable(self, user: ClientId, floor: float) -> bool:
        return (
            not self.active.is_active(user)
            and user not in self.running
            and user != self.active.last_left
            and self.counters.get(user, 0.0) <= floor
        )

    def forget(self, user: ClientId, drop: Callable[[ClientId], None] | None = None) -> None:
        """Drop ``user`` if forgetting it changes no decision (module docstring); then, once
        the counters have doubled since the last sweep, every such user (amortized O(1))."""
        floor = self.floor()
        if user in self.counters and self.forgettable(user, floor):
            self._drop(user, drop)
        if len(self.counters) > self._sweep_at:
            for u in [u for u in self.counters if self.forgettable(u, floor)]:
                self._drop(u, drop)
            self._sweep_at = 2 * len(self.counters) + self.sweep_min

    def _drop(self, user: ClientId, drop: Callable[[ClientId], None] | None) -> None:
        del self.counters[user]
        self.num_forgotten += 1
        if drop is not None:
            drop(user)
