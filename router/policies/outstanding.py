"""Outstanding work per worker, in weighted tokens: a load measure that sees request sizes.

Counting queued requests treats a 16-call judge fan-out of 2,000-token prompts like 16
one-line chats. This tracker prices each in-flight request at dispatch as

    w_e · (input_len − prefix matched on the chosen worker) + w_o · expected output

— the same units as D2LPM's deficits — and removes exactly that price when the request
finishes (ok or not) or its worker is removed. The expected output is the client's mean
output length over its finished requests (``default_output_len`` before its first one),
capped at the request's ``max_new_tokens``; it is kept for the ``max_clients`` clients that
finished most recently (a client dropped from it is priced as a new one). Nothing here reads
``Request.output_len``, which a live router cannot know.
"""

from __future__ import annotations

from sgl_fair.messages import Finished
from sgl_fair.request import ClientId, Request


class OutstandingWork:
    """``of(worker)``: the weighted tokens dispatched to it and not yet reported finished."""

    def __init__(
        self,
        *,
        extend_weight: float,
        output_weight: float,
        default_output_len: float,
        max_clients: int = 10_000,
    ) -> None:
        self.max_clients = max_clients
        self.extend_weight = extend_weight
        self.output_weight = output_weight
        self.default_output_len = default_output_len
        self._load: dict[int, float] = {}
        self._inflight: dict[str, tuple[int, float]] = {}  # rid -> (worker, price)
        self._outputs: dict[ClientId, tuple[int, int]] = {}  # client -> (finished, tokens)
        self._priced = 0.0  # sum of all prices so far, for ``mean_price``
        self._num_priced = 0

    def of(self, worker: int) -> float:
        return self._load.get(worker, 0.0)

    @property
    def mean_price(self) -> float:
        """The mean price of a dispatched request (the default output's price before any)."""
        if self._num_priced:
            return self._priced / self._num_priced
        return self.output_weight * self.default_output_len

    def expected_output(self, req: Request) -> float:
        done, tokens = self._outputs.get(req.client, (0, 0))
        mean = tokens / done if done else self.default_output_len
        cap = req.max_new_tokens
        return min(mean, cap) if cap is not None else mean

    def dispatched(self, req: Request, worker: int, extend_len: int) -> None:
        price = self.extend_weight * extend_len + self.output_weight * self.expected_output(req)
        self._inflight[req.rid] = (worker, price)
        self._load[worker] = self._load.get(worker, 0.0) + price
        self._priced += price
        self._num_priced += 1

    def finished(self, msg: Finished) -> None:
        entry = self._inflight.pop(msg.rid, None)
        if entry is not None and entry[0] == msg.worker:
            worker, price = entry
            left = self._load.get(worker, 0.0) - price
            self._load[worker] = left if left > 1e-6 else 0.0
        elif entry is not None:  # re-dispatched elsewhere since: keep its newer entry
            self._inflight[msg.rid] = entry
        if msg.ok:
            done, tokens = self._outputs.pop(msg.client, (0, 0))
            self._outputs[msg.client] = (done + 1, tokens + msg.num_output)  # most recent last
            if len(self._outputs) > self.max_clients:
                del self._outputs[next(iter(self._outputs))]

    def worker_removed(self, worker: int) -> None:
        self._load.pop(worker, None)
        for rid in [r for r, (u, _) in self._inflight.items() if u == worker]:
            del self._inflight[rid]
