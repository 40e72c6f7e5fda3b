"""D2LPM — Double Deficit LPM, the global router (DLPM paper §5.2, Alg. 2; SPEC §3).

Locality first, until a per-(worker, client) deficit says a client has had its share of a
worker. State: ``D[u][c]`` (starts at 0) and a quantum ``Q_u`` per worker.

* Dispatch of r from c: ``W`` = workers holding r's longest matched prefix (all alive
  workers if nothing matched). If every alive worker has ``D[u][c] <= 0``, replenish
  ``D[u][c] += Q_u`` on all of them. Pick the least-queued worker in ``W`` with
  ``D[u][c] > 0``; if there is none, the least-queued worker anywhere with ``D[u][c] > 0``
  (ties: lowest id). Charge ``D[u][c] -= w_e * (input_len - matched_len_on_u)``.
* Completion (ok or not, the tokens actually produced): ``D[u][c] -= w_o * num_output``.

Replenishing adds as many rounds as it takes for some worker to turn positive: when one
request costs more than a quantum, a single round may leave every deficit <= 0, and
``k`` rounds at once equal ``k`` consecutive replenishments that each found no candidate
(DLPM's walk does the same).

``Q_u = inf`` makes the deficits never bind: pure locality-first dispatch (least-queued
among holders), which is not fair (Thm A.5). A dead worker's deficits are forgotten; a
worker that (re)joins starts at 0.

**Load guard** *(beyond the paper)*. The deficit binds only as service is charged, and a
hot prefix costs almost nothing to extend while its outputs are charged only when requests
finish: one tenant's 3,000 requests on one cached prefix all went to the worker holding it,
2,824 of them waiting there, while three workers sat idle. So locality is taken only from a
holder whose queue is at most ``max_queue_ratio`` × the mean queue of the alive workers plus
``queue_slack``; past it the request goes to the least-queued eligible worker (which then
holds the prefix too, so locality spreads instead of piling up). ``max_queue_ratio = inf``
is the paper's exact rule.

Options (``make_router_policy("d2lpm", ...)``): ``quantum`` (10,000.0, service units; may be
``float('inf')``), ``quanta`` (per-worker overrides of ``quantum``, ``{}``),
``extend_weight`` (``w_e``, 1.0), ``output_weight`` (``w_o``, 2.0), ``max_queue_ratio``
(2.0; ``inf``: off), ``queue_slack`` (8 requests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sgl_fair.messages import Finished
from sgl_fair.request import ClientId, Request
from sgl_fair.router.global_tree import GlobalMatch
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    check_positive,
    least_queued,
    register_router_policy,
)


@register_router_policy("d2lpm")
class D2LPM(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        quantum: float = 10_000.0
        quanta: Mapping[int, float] = field(default_factory=dict)
        extend_weight: float = 1.0
        output_weight: float = 2.0
        max_queue_ratio: float = 2.0
        queue_slack: float = 8.0

        def __post_init__(self) -> None:
            check_positive("d2lpm", quantum=self.quantum)
            if not self.max_queue_ratio >= 1:
                raise ValueError(
                    f"d2lpm: max_queue_ratio must be >= 1 (got {self.max_queue_ratio})"
                )
            if not (self.queue_slack >= 0 and math.isfinite(self.queue_slack)):
                raise ValueError(
                    f"d2lpm: queue_slack must be finite and >= 0 (got {self.queue_slack})"
                )
            for worker, q in self.quanta.items():
                check_positive("d2lpm", **{f"quanta[{worker}]": q})
            for key in ("extend_weight", "output_weight"):
                value = getattr(self, key)
                if not (value >= 0 and math.isfinite(value)):
                    raise ValueError(f"d2lpm: {key} must be finite and >= 0 (got {value})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self._deficits: dict[ClientId, dict[int, float]] = {}  # client -> worker -> D
        self._unbounded = {u for u, q in self.config.quanta.items() if q == math.inf}
        self._bounded = {u for u, q in self.config.quanta.items() if q != math.inf}

    def quantum_of(self, worker: int) -> float:
        return self.config.quanta.get(worker, self.config.quantum)

    def deficit(self, worker: int, client: ClientId) -> float:
        return self._deficits.get(client, {}).get(worker, 0.0)

    def _eligible(self, workers: Sequence[int], client: ClientId) -> list[int]:
        """Workers where ``client`` has deficit left (an infinite quantum never runs out)."""
        d = self._deficits.get(client, {})
        if self.config.quantum == math.inf:
            bounded = self._bounded
            return [u for u in workers if u not in bounded or d.get(u, 0.0) > 0]
        unbounded = self._unbounded
        return [u for u in workers if d.get(u, 0.0) > 0 or u in unbounded]

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        workers = view.workers
        client = req.client
        eligible = self._eligible(workers, client)
        if not eligible:
            self._replenish(workers, client)
            eligible = self._eligible(workers, client)
        if match.length:
            holders = match.holders
            local = [u for u in eligible if u in holders and not self._overloaded(u, view)]
            if local:
                return least_queued(local, view)
        return least_queued(eligible, view)

    def _overloaded(self, worker: int, view: RouterView) -> bool:
        ratio = self.config.max_queue_ratio
        if ratio == math.inf:
            return False
        workers = view.workers
        mean = sum(view.queue_len(u) for u in workers) / len(workers)
        return view.queue_len(worker) > ratio * mean + self.config.queue_slack

    def _replenish(self, workers: Sequence[int], client: ClientId) -> None:
        # Every D[u][c] <= 0 and every Q_u finite here; the fewest rounds that make some
        # deficit positive.
        d = self._deficits.setdefault(client, {})
        rounds = min(math.floor(-d.get(u, 0.0) / self.quantum_of(u)) + 1 for u in workers)
        for u in workers:
            d[u] = d.get(u, 0.0) + rounds * self.quantum_of(u)

    def _charge(self, worker: int, client: ClientId, service: float) -> None:
        d = self._deficits.get(client)
        if d is None:
            d = self._deficits[client] = {}
        d[worker] = d.get(worker, 0.0) - service

    def on_dispatched(
        self, req: Request, worker: int, match: GlobalMatch, view: RouterView
    ) -> None:
        extend_len = req.input_len - match.per_worker.get(worker, 0)
        self._charge(worker, req.client, self.config.extend_weight * extend_len)

    def on_finished(self, msg: Finished, view: RouterView) -> None:
        if msg.worker in view.workers:
            self._charge(msg.worker, msg.client, self.config.output_weight * msg.num_output)

    def on_worker_removed(self, worker: int) -> None:
        for d in self._deficits.values():
            d.pop(worker, None)
