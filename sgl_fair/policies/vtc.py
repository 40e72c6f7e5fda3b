"""VTC — Virtual Token Counter (VTC paper, Alg. 2 and 4; SPEC §1).

Per client a counter ``v_c`` of (weighted) service received. Admission always
takes the earliest request of the client with the smallest counter and charges
its input at admission; every generated token is charged as it is produced.
A client (re)joining the queue is *lifted* to the smallest active counter (or to
the last leaver's if the queue was empty), so credit is never carried over.

Variants, all in this one class because they differ only in bookkeeping:

* weighted: every increment divided by the client's weight (``weights``);
* length prediction (``predict="predict"``, ``"ema"`` or ``"oracle"``): charge the
  predicted output at admission, then only tokens beyond it, refunding unused
  prediction at finish. ``predict`` = mean output of the client's last
  ``history`` requests (the paper's predictor); ``ema`` = the VTC artifact's moving
  average ``pred ← (4·pred + actual) / 5``, a client's first request predicted 0;
  ``oracle`` = the true length, optionally perturbed uniformly by ±``oracle_noise``
  (the paper's "VTC (±50%)").
* ``lift=False`` is LCF, registered separately in ``lcf.py``.

State per client is bounded (``forget_idle``, default on, with the lift): a client with
nothing queued or running whose counter is at or below the lift floor is forgotten — it
would be lifted to the floor anyway. Without prediction counters never fall, so neither
does the floor, and forgetting changes no decision (tested with and without it). With a
prediction a refund can lower the floor below a forgotten client's old counter; that client
then comes back at most one refund ahead. The predictor's per-client state (``predict``,
``ema``) is kept for the ``history_clients`` (10,000) most recently finished clients; a
client dropped from it is predicted as a new one.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from sgl_fair.cost import CostFunction, WeightedTokens, resolve_cost
from sgl_fair.policies.base import (
    BasePolicy,
    Rejection,
    SchedulerView,
    WeightsOption,
    client_weight,
    register,
    waiting_groups,
)
from sgl_fair.request import ClientId, Request

PREDICT_MODES = ("none", "predict", "ema", "oracle")
_SWEEP_MIN = 1024  # forget idle clients once the counters outgrow this (then 2x, amortized)


@register("vtc")
class VTC(WeightsOption, BasePolicy):  # Weighted: its Config takes weights
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
        forget_idle: bool = True
        history_clients: int = 10_000

        def __post_init__(self) -> None:
            object.__setattr__(self, "cost", resolve_cost(self.cost))  # by name: cost.COSTS
            if self.predict not in PREDICT_MODES:
                raise ValueError(
                    f"vtc: predict must be one of {', '.join(PREDICT_MODES)} (got {self.predict!r})"
                )
            bad = {c: w for c, w in self.weights.items() if not w > 0}
            if bad:
                raise ValueError(f"vtc: weights must be > 0 (got {bad})")
            if self.history < 1:
                raise ValueError(f"vtc: history must be >= 1 (got {self.history})")
            if self.history_clients < 1:
                raise ValueError(f"vtc: history_clients must be >= 1 (got {self.history_clients})")
            if not 0.0 <= self.oracle_noise < 1.0:
                raise ValueError(f"vtc: oracle_noise must be in [0, 1) (got {self.oracle_noise})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.counters: dict[ClientId, float] = {}
        self._predicted: dict[int, int] = {}  # id(req) -> predicted output tokens charged
        self._history: dict[ClientId, deque[int]] = {}  # predict: the last outputs
        self._ema: dict[ClientId, float] = {}  # ema: the moving average
        self._rng = random.Random(self.config.seed)
        self._running: dict[ClientId, int] = {}  # admitted requests not yet finished
        self.sweep_min = self._sweep_at = _SWEEP_MIN  # (tests lower it)
        self.num_forgotten = 0

    # ---------------------------------------------------------------- accounting

    def counter(self, client: ClientId) -> float:
        return self.counters.get(client, 0.0)

    service_received = counter  # the share guard's measure (policies/base.py)

    @property
    def predictor(self) -> str:
        """``Predicting``: the output-length predictor it charges with (``predict``)."""
        return self.config.predict

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
        self._running[req.client] = self._running.get(req.client, 0) + 1
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
        self._learn(req.client, req.num_output)
        c = req.client
        n = self._running.get(c, 0) - 1
        if n > 0:
            self._running[c] = n
        else:
            self._running.pop(c, None)
        if self.config.forget_idle and self.config.lift and len(self.counters) > self._sweep_at:
            self._forget_idle()

    def _learn(self, client: ClientId, output: int) -> None:
        """Feed the predictor (only the one in use keeps state), most recent client last."""
        mode = self.config.predict
        if mode == "predict":
            hist = self._history.pop(client, None) or deque(maxlen=self.config.history)
            hist.append(output)
            self._history[client] = hist
            table: dict = self._history
        elif mode == "ema":
            self._ema[client] = (4 * self._ema.pop(client, 0.0) + output) / 5
            table = self._ema
        else:
            return
        if len(table) > self.config.history_clients:  # least recently finished first
            del table[next(iter(table))]

    def _floor(self) -> float:
        if len(self.active) == 0:
            last = self.active.last_left
            return self.counter(last) if last is not None else 0.0
        return min(self.counter(k) for k in self.active.clients())

    def _forget_idle(self) -> None:
        """Drop every idle client at or below the floor (module docstring); amortized."""
        floor, last = self._floor(), self.active.last_left
        for c in [
            c
            for c, v in self.counters.items()
            if v <= floor and c != last and c not in self._running and not self.active.is_active(c)
        ]:
            del self.counters[c]
            self.num_forgotten += 1
        self._sweep_at = 2 * len(self.counters) + self.sweep_min

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
        if mode == "ema":  # the artifact's: 0 for a client's first request
            return round(self._ema.get(req.client, 0.0))
        return None

    # ---------------------------------------------------------------- admission order

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        """Earliest request of the least-counter client, recomputed after every admission."""
        queues = {c: deque(reqs) for c, reqs in waiting_groups(waiting, view).items()}
        heap = [(self.counter(c), q[0].arrival_key(), c) for c, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, _, c = heapq.heappop(heap)
            q = queues[c]
            yield q.popleft()
            # Resumed: the request was admitted and on_admitted charged c.
            if q:
                heapq.heappush(heap, (self.counter(c), q[0].arrival_key(), c))
