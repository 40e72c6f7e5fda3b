"""DLPM — Deficit Longest Prefix Match (DLPM paper §4, Alg. 1; SPEC §2), one worker.

Walk the waiting queue in LPM order; admit a request only while its client has
deficit ``d_c > 0`` and charge ``w_e * extend_tokens``; when every active client
is out of deficit, give each active client a quantum ``Q`` and keep walking.
Decoding charges ``w_o`` per generated token.

``Q → ∞`` is LPM (pure locality), ``Q → 0`` approaches VTC (pure fairness);
backlogged clients' service differs by at most ``2·(Q + U)`` (Thm 4.1).

Rejoin: by default a client whose queue went empty → non-empty keeps its debt
(``d_c = min(d_c, 0)``) so pausing briefly cannot erase it; ``reset_on_rejoin``
is the paper's ``d_c = 0``.

State per client is bounded (``forget_idle``, default on). A client with nothing queued or
running is forgotten where that changes no decision: its deficit once it is >= 0 (a rejoin
turns it into 0 either way; any deficit with ``reset_on_rejoin``), its service measure once
it is at or below the lift floor (which never falls). A debt (deficit < 0) is kept for the
``idle_clients`` (10,000) most recently idle debtors; an older one is forgiven, as the paper's
rejoin rule forgives every debt.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.cost import CostFunction, PrefixAwareTokens, resolve_cost
from sgl_fair.policies.base import (
    BasePolicy,
    Rejection,
    SchedulerView,
    WeightsOption,
    client_weight,
    register,
)
from sgl_fair.policies.lpm import lpm_order
from sgl_fair.request import ClientId, Request

_SWEEP_MIN = 1024  # sweep the idle clients once they outgrow this (then 2x, amortized)


@register("dlpm")
class DLPM(WeightsOption, BasePolicy):  # Weighted: its Config takes weights
    asks_prefix_len = True
    shares_running = True

    @dataclass(frozen=True)
    class Config:
        quantum: float = 2048.0
        cost: CostFunction = field(default_factory=PrefixAwareTokens)
        weights: Mapping[ClientId, float] = field(default_factory=dict)
        reset_on_rejoin: bool = False
        forget_idle: bool = True
        idle_clients: int = 10_000

        def __post_init__(self) -> None:
            object.__setattr__(self, "cost", resolve_cost(self.cost))  # by name: cost.COSTS
            if not self.quantum > 0:
                raise ValueError(f"dlpm: quantum must be > 0 (got {self.quantum})")
            bad = {c: w for c, w in self.weights.items() if not w > 0}
            if bad:
                raise ValueError(f"dlpm: weights must be > 0 (got {bad})")
            if self.idle_clients < 0:
                raise ValueError(f"dlpm: idle_clients must be >= 0 (got {self.idle_clients})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.deficits: dict[ClientId, float] = {}
        # Weighted service received, lifted on rejoin by VTC's rule (to the least active
        # client's, or the last leaver's if none waits): the share guard's measure
        # (policies/base.py); the walk never reads it.
        self.served: dict[ClientId, float] = {}
        self._running: dict[ClientId, int] = {}  # admitted requests not yet finished
        self._idle: dict[
            ClientId, None
        ] = {}  # clients with nothing queued or running, oldest first
        self.sweep_min = self._sweep_at = _SWEEP_MIN  # (tests lower it)
        self.num_forgotten = 0

    def service_received(self, client: ClientId) -> float:
        return self.served.get(client, 0.0)

    def deficit(self, client: ClientId) -> float:
        return self.deficits.get(client, 0.0)

    def _charge(self, client: ClientId, service: float) -> None:
        w = client_weight(self.config.weights, client)
        self.deficits[client] = self.deficit(client) - service / w
        self.served[client] = self.service_received(client) + service / w

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        c = req.client
        self._idle.pop(c, None)
        if not self.active.is_active(c):  # (re)joins
            floor = self._floor()
            self.active.enqueue(c)
            d = self.deficit(c)
            self.deficits[c] = 0.0 if self.config.reset_on_rejoin else min(d, 0.0)
            self.served[c] = max(self.service_received(c), floor)
        else:
            self.active.enqueue(c)
        return None

    def _floor(self) -> float:
        """The service floor a rejoining client is lifted to (VTC's rule)."""
        if len(self.active):
            return min(self.service_received(o) for o in self.active.clients())
        last = self.active.last_left
        return self.service_received(last) if last is not None else 0.0

    def on_finished(self, req: Request) -> None:
        c = req.client
        n = self._running.get(c, 0) - 1
        if n > 0:
            self._running[c] = n
            return
        self._running.pop(c, None)
        if not self.active.is_active(c):
            self._idle[c] = None
        if self.config.forget_idle and len(self._idle) > self._sweep_at:
            self._forget_idle()

    def on_aborted(self, req: Request, waiting: bool) -> None:
        super().on_aborted(req, waiting)
        c = req.client
        if waiting and not self.active.is_active(c) and c not in self._running:
            self._idle[c] = None

    def _forget_idle(self) -> None:
        """Forget what no decision needs (module docstring); amortized O(1) per finish."""
        floor, last = self._floor(), self.active.last_left
        reset = self.config.reset_on_rejoin
        debtors = []
        for c in list(self._idle):
            if self.active.is_active(c) or c in self._running:  # (not idle any more)
                del self._idle[c]
                continue
            if c != last and self.service_received(c) <= floor:
                self.served.pop(c, None)
            if reset or self.deficit(c) >= 0:
                self.deficits.pop(c, None)
            if c in self.deficits:
                debtors.append(c)
            elif c not in self.served:
                del self._idle[c]
                self.num_forgotten += 1
        for c in debtors[: max(len(debtors) - self.config.idle_clients, 0)]:
            del self.deficits[c]  # the oldest debts beyond the bound: forgiven
            if c not in self.served:
                del self._idle[c]
                self.num_forgotten += 1
        self._sweep_at = 2 * len(self._idle) + self.sweep_min

    def on_admitted(self, req: Request, extend_len: int) -> None:
        super().on_admitted(req, extend_len)
        if req.num_retractions == 0:  # a re-admitted request already paid
            self._running[req.client] = self._running.get(req.client, 0) + 1
            self._idle.pop(req.client, None)
            cost = self.config.cost.input_cost(input_len=req.input_len, extend_len=extend_len)
            self._charge(req.client, cost)

    def on_tokens(self, req: Request, n: int) -> None:
        end = req.num_output
        cost = self.config.cost.output_cost(input_len=req.input_len, start=end - n, end=end)
        self._charge(req.client, cost)

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        """Alg. 1's walk: passes over the LPM order, admitting clients with deficit left.

        A client's deficit changes only through its own admissions during a walk, so in one
        pass a client yields exactly its LPM-ordered requests up to the one that exhausts
        its deficit. Merging the clients' queues by LPM rank (a heap) yields the very same
        sequence as scanning the list, without touching skipped requests again.
        """
        kept = getattr(view, "lpm_groups", None)  # optional: kept across passes by the view
        queues: dict[ClientId, deque[tuple[Any, Request]]] | None = kept() if kept else None
        if queues is None:
            queues = {}
            for rank, req in enumerate(lpm_order(waiting, view)):
                queues.setdefault(req.client, deque()).append((rank, req))
        while queues:
            heap = [(q[0][0], c) for c, q in queues.items() if self.deficit(c) > 0]
            heapq.heapify(heap)
            while heap:
                _, c = heapq.heappop(heap)
                q = queues[c]
                yield q.popleft()[1]  # resumed only if admitted (and charged)
                if not q:
                    del queues[c]
                elif self.deficit(c) > 0:
                    heapq.heappush(heap, (q[0][0], c))
            if queues:
                # Every active client is out of deficit: replenish (Alg. 1 line 7). Doing
                # k rounds at once equals k passes that each admit nothing.
                self._replenish(set(queues))

    def _replenish(self, clients: set[ClientId]) -> None:
        # Deficits are kept in weight-normalised units (charges are divided by the weight),
        # so every active client gets the same quantum and service splits by weight.
        q = self.config.quantum
        need = min(-self.deficit(c) for c in clients)
        rounds = math.floor(need / q) + 1
        for c in clients:
            self.deficits[c] = self.deficit(c) + rounds * q
