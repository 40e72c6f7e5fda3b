"""One clock for every tensor-parallel rank of an SGLang server.

Each TP rank runs its own scheduler and our policy in each must decide exactly alike (an
admission on one rank and not another hangs the collectives or mixes outputs). A process's own
clock differs across ranks by microseconds to milliseconds, enough to flip an ``rpm`` window, a
``fairserve`` timeout or a ``bros`` deadline. So the plugin never reads one: the rank that pulls
requests from the tokenizer (``SchedulerRequestReceiver._pull_raw_reqs``, attention-TP rank 0)
adds a ``Tick`` with its clock to what it pulled, SGLang's own broadcast of the requests
(``_broadcast_reqs_across_ranks``) carries it to every rank, and there the plugin takes it out
before SGLang sees the list. ``RankClock()`` is the last tick: identical on every rank, and
constant within a scheduler iteration (every decision of one pass reads the same time).

Pipeline stages must plan the same batches too. Stage k > 0 pulls nothing from the tokenizer:
stage k − 1 sends it what it ingested (``Scheduler.ingest_requests``' return value exists for
that relay), so the plugin adds the tick there (``relay``) and a later stage never stamps
its own: every stage reads stage 0's reading, taken with the requests it came with.

Pure: no sglang import (``plugin.py`` hooks these into SGLang).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tick:
    """The pulling rank's clock, in the request list SGLang broadcasts to its TP ranks."""

    t: float


class RankClock:
    """The time of the last ``Tick`` this process received. Before the first one (a host
    that never pulls through the hooked receiver: tests, benches) it reads ``source``."""

    def __init__(self, source: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.t: float | None = None
        self.num_ticks = 0
        self._relayed: float | None = None  # the last tick relayed to the next PP stage

    def __call__(self) -> float:
        t = self.t
        return self.source() if t is None else t

    def stamp(self, pulled: list[Any]) -> None:
        """On the pulling rank: add this iteration's tick to the requests it pulled."""
        pulled.append(Tick(self.source()))

    def has_news(self) -> bool:
        """A tick not relayed yet."""
        return self.t is not None and self.t != self._relayed

    def relay(self, reqs: list[Any]) -> None:
        """On a pipeline stage that sends what it ingested on to the next stage: add the
        tick it decides by, when it changed since the last one sent (stage 0's reading
        reaches every stage with the requests it came with; a stage never stamps its own)."""
        t = self.t
        if t is not None and t != self._relayed:
            reqs.append(Tick(t))
            self._relayed = t

    def take(self, reqs: list[Any]) -> list[Any]:
        """On every rank, after the broadcast: take the ticks out, keep the latest."""
        if not any(type(r) is Tick for r in reqs):
            return reqs
        rest = []
        for r in reqs:
            if type(r) is Tick:
                self.t = r.t if self.t is None else max(self.t, r.t)
                self.num_ticks += 1
            else:
                rest.append(r)
        return rest


# The scheduler process's clock (one scheduler, one rank, per process).
RANK_CLOCK = RankClock()

__all__ = ["RANK_CLOCK", "RankClock", "Tick"]
