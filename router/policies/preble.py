"""Preble's E2 dispatch (SPEC §3), an approximation: exploit a long cached prefix, else explore.

* Exploit when the longest held prefix is at least the unmatched remainder
  (``match.length >= input_len - match.length``, Preble's "hit ratio > 50 %"): the least
  loaded worker among those holding it.
* Explore otherwise: the least loaded worker overall.
* Rebalance: if the exploit target's load exceeds ``imbalance`` × the lightest worker's
  load, send the request to the lightest worker instead; the router then records the
  prefix there too, so a hot prefix spreads to more workers.

Load of a worker = sum, over the requests dispatched to it in the last ``window_s``, of
``prefill_weight`` × its missed tokens (input_len − prefix matched on that worker) plus
``output_weight`` × its output tokens. The output is estimated at dispatch as the running
mean of finished requests' outputs (``default_output_len`` before any finished) and
corrected to the real count when the request finishes. Ties go to the lowest worker id.

How this differs from Preble itself: Preble prices prefill and decode with a profiled
latency model, charges a candidate the cost of its eviction, moves *prefixes* (not single
requests) off overloaded GPUs and autoscales hot prefixes; here the costs are weighted
token counts, and moving is per request — enough to reproduce the behaviour the DLPM paper
compares against (locality first, load-balanced under imbalance, no fairness). The local
half of Preble (priority groups by hit ratio) is the worker policy ``preble-local``.

Options: ``window_s`` (180.0), ``prefill_weight`` (1.0), ``output_weight`` (2.0),
``imbalance`` (1.5), ``default_output_len`` (128.0).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from sgl_fair.messages import Finished
from sgl_fair.request import Request
from sgl_fair.router.global_tree import GlobalMatch
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    check_positive,
    register_router_policy,
)


class _Entry:
    """One dispatched request's contribution to its worker's windowed load."""

    __slots__ = ("t_s", "worker", "rid", "prefill", "decode")

    def __init__(self, t_s: float, worker: int, rid: str, prefill: float, decode: float):
        self.t_s = t_s
        self.worker = worker
        self.rid = rid
        self.prefill = prefill
        self.decode = decode


@register_router_policy("preble")
class Preble(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        window_s: float = 180.0
        prefill_weight: float = 1.0
        output_weight: float = 2.0
        imbalance: float = 1.5
        default_output_len: float = 128.0

        def __post_init__(self) -> None:
            check_positive("preble", window_s=self.window_s, imbalance=self.imbalance)
            for key in ("prefill_weight", "output_weight", "default_output_len"):
                value = getattr(self, key)
                if not (value >= 0 and math.isfinite(value)):
                    raise ValueError(f"preble: {key} must be finite and >= 0 (got {value})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self._window: dict[int, deque[_Entry]] = {}
        self._load: dict[int, float] = {}
        self._by_rid: dict[str, _Entry] = {}  # entries still in the window, not finished
        self._num_finished = 0
        self._sum_output = 0

    @property
    def expected_output_len(self) -> float:
        if not self._num_finished:
            return self.config.default_output_len
        return self._sum_output / self._num_finished

    def load(self, worker: int, now: float) -> float:
        """The worker's load over ``(now - window_s, now]``."""
        window = self._window.get(worker)
        if not window:
            return 0.0
        horizon = now - self.config.window_s
        while window and window[0].t_s <= horizon:
            entry = window.popleft()
            if self._by_rid.get(entry.rid) is entry:
                del self._by_rid[entry.rid]
            self._load[worker] -= entry.prefill + entry.decode
        if not window:
            self._load[worker] = 0.0  # no float residue from the running sum
        return self._load[worker]

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        workers = view.workers
        now = view.now
        loads = {u: self.load(u, now) for u in workers}

        def lightest(candidates):
            return min(candidates, key=lambda u: (loads[u], u))

        coolest = lightest(workers)
        hit = match.length
        if hit and hit >= req.input_len - hit:
            holders = [u for u in workers if u in match.holders]
            if holders:
                target = lightest(holders)
                if loads[target] > self.config.imbalance * loads[coolest]:
                    return coolest  # rebalance: the hot prefix gains a holder
                return target
        return coolest

    def on_dispatched(
        self, req: Request, worker: int, match: GlobalMatch, view: RouterView
    ) -> None:
        cfg = self.config
        missed = req.input_len - match.per_worker.get(worker, 0)
        entry = _Entry(
            view.now,
            worker,
            req.rid,
            cfg.prefill_weight * missed,
            cfg.output_weight * self.expected_output_len,
        )
        self._window.setdefault(worker, deque()).append(entry)
        self._load[worker] = self._load.get(worker, 0.0) + entry.prefill + entry.decode
        self._by_rid[req.rid] = entry

    def on_finished(self, msg: Finished, view: RouterView) -> None:
        if msg.ok:
            self._num_finished += 1
            self._sum_output += msg.num_output
        entry = self._by_rid.get(msg.rid)
        if entry is not None and entry.worker == msg.worker:
            del self._by_rid[msg.rid]
            actual = self.config.output_weight * msg.num_output
            self._load[entry.worker] += actual - entry.decode
            entry.decode = actual

    def on_worker_removed(self, worker: int) -> None:
        for entry in self._window.pop(worker, ()):
            if self._by_rid.get(entry.rid) is entry:
                del self._by_rid[entry.rid]
        self._load.pop(worker, None)
