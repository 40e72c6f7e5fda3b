"""VTC — Virtual Token Counter (VTC paper, Alg. 2 and 4; SPEC §1).

Per client a counter ``v_c`` of (weighted) service received. Admission always
takes the earliest request of the client with the smallest counter and charges
its input at admission; every generated token is charged as it is produced.
A client (re)joining the queue is *lifted* to the smallest active counter (or to
the last leaver's if the queue was empty), so credit is never carried over.

Variants, all in this one class because they differ only in bookkeeping:

* weighted: every increment divided by the client's weight (``weights``);
* length prediction (``predict="predict"`` or ``"oracle"``): charge the
  predicted output at admission, then only tokens beyond it, refunding unused
  prediction at finish. ``predict`` = mean output of the client's last
  ``history`` requests; ``oracle`` = the true length, optionally perturbed
  uniformly by ±``oracle_noise`` (the paper's "VTC (±50%)").
* ``lift=False`` is LCF, registered separately in ``lcf.py``.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from sgl_fair.cost import CostFunction, WeightedTokens
from sgl_fair.policies.base import (
    BasePolicy,
    Rejection,
    SchedulerView,
    client_weight,
    group_by_client,
    register,
)
from sgl_fair.request import ClientId, Request

PREDICT_MODES = ("none", "predict", "oracle")


@register("vtc")
class VTC(BasePolicy):
    shares_running = True

    @dataclass(frozen=True)
    class Config:
        weights: Mapping[ClientId, float] = field(default_factory=dict)
        cost: CostFunction = field(default_factory=WeightedTokens)
        predict: str = "none"
        history: int = 5
        oracle_noise: float = 0.0
        seed: int = 0
        lift: bool = True

        def __post_init__(self) -> None:
            if self.predict not in PREDICT_MODES:
                raise ValueError(
                    f"vtc: predict must be one of {', '.join(PREDICT_MODES)} (got {self.predict!r})"
                )
            bad = {c: w for c, w in self.weights.items() if not w > 0}
            if bad:
                raise ValueError(f"vtc: weights must be > 0 (got {bad})")
            if self.history < 1:
                raise ValueError(f"vtc: history must be >= 1 (got {self.history})")
            if not 0.0 <= self.oracle_noise < 1.0:
                raise ValueError(f"vtc: oracle_noise must be in [0, 1) (got {self.oracle_noise})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.counters: dict[ClientId, float] = {}
        self._predicted: dict[int, int] = {}  # id(req) -> predicted output tokens charged
        self._history: dict[ClientId, deque[int]] = {}
        self._rng = random.Random(self.config.seed)

    # ---------------------------------------------------------------- accounting

    def counter(self, client: ClientId) -> float:
        return self.counters.get(client, 0.0)

    service_received = counter  # the share guard's measure (policies/base.py)

    def _charge(self, client: ClientId, service: float) -> None:
        w = client_weight(self.config.weights, client)
        self.counters[client] = self.counter(client) + service / w

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        c = req.client
        queue_was_empty = len(self.active) == 0
        rejoined = self.active.enqueue(c)
        if rejoined and self.config.lift:
            self._lift(c, queue_was_empty)
        return None

    def _lift(self, client: ClientId, queue_was_empty: bool) -> None:
        if queue_was_empty:
            last = self.active.last_left
            floor = self.counter(last) if last is not None else 0.0
        else:
            floor = min(self.counter(k) for k in self.active.clients() if k != client)
        self.counters[client] = max(self.counter(client), floor)

    def on_admitted(self, req: Request, extend_len: int) -> None:
        super().on_admitted(req, extend_len)
        if req.num_retractions > 0:
            return  # re-admission after a retraction: the client already paid for this work
        cost = self.config.cost
        self._charge(req.client, cost.input_cost(input_len=req.input_len, extend_len=extend_len))
        predicted = self._prediction(req)
        if predicted is not None:
            self._predicted[id(req)] = predicted
            self._charge(
                req.client, cost.output_cost(input_len=req.input_len, start=0, end=predicted)
            )

    def on_tokens(self, req: Request, n: int) -> None:
        end = req.num_output  # the scheduler appends tokens before reporting them
        start = end - n
        covered = self._predicted.get(id(req), 0)
        start = max(start, covered)
        if end > start:
            self._charge(
                req.client,
                self.config.cost.output_cost(input_len=req.input_len, start=start, end=end),
            )

    def on_finished(self, req: Request) -> None:
        predicted = self._predicted.pop(id(req), None)
        if predicted is not None and predicted > req.num_output:
            refund = self.config.cost.output_cost(
                input_len=req.input_len, start=req.num_output, end=predicted
            )
            self._charge(req.client, -refund)
        hist = self._history.setdefault(req.client, deque(maxlen=self.config.history))
        hist.append(req.num_output)

    def _prediction(self, req: Request) -> int | None:
        mode = self.config.predict
        if mode == "oracle":
            noise = self.config.oracle_noise
            factor = 1.0 + self._rng.uniform(-noise, noise) if noise else 1.0
            return max(1, round(req.output_len * factor))
        if mode == "predict":
            hist = self._history.get(req.client)
            if hist:
                return max(1, round(sum(hist) / len(hist)))
        return None

    # ---------------------------------------------------------------- admission order

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        """Earliest request of the least-counter client, recomputed after every admission."""
        queues = {c: deque(reqs) for c, reqs in group_by_client(waiting).items()}
        heap = [(self.counter(c), q[0].arrival_key(), c) for c, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, _, c = heapq.heappop(heap)
            q = queues[c]
            yield q.popleft()
            # Resumed: the request was admitted and on_admitted charged c.
            if q:
                heapq.heappush(heap, (self.counter(c), q[0].arrival_key(), c))
