"""LPM: longest cached prefix first (SGLang's ``lpm``), ties by arrival.

Unlike SGLang, which falls back to FCFS above 128 waiting requests, we always
sort: prefix matching is O(prompt) per request (see bench/bench_policy_step.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import BasePolicy, SchedulerView, register
from sgl_fair.request import Request


def lpm_order(waiting: Sequence[Request], view: SchedulerView) -> list[Request]:
    """Waiting requests sorted by matched prefix length (longest first), then arrival.

    ``waiting`` comes in arrival order (the scheduler's contract), and a stable sort on
    the length alone keeps that order among ties: no tuple keys on the hot path.
    """
    many = getattr(view, "prefix_lens", None)  # optional: a view may answer in one call
    lens = many(waiting) if many is not None else [view.prefix_len(r) for r in waiting]
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    return [waiting[i] for i in order]


@register("lpm")
class LPM(BasePolicy):
    asks_prefix_len = True

    @dataclass(frozen=True)
    class Config:
        pass

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        kept = getattr(view, "lpm_groups", None)  # optional: kept across passes by the view
        groups = kept() if kept is not None else None
        if groups is not None:  # each client's requests in order: merged by their keys
            return (req for _, req in heapq.merge(*groups.values()))
        return iter(lpm_order(waiting, view))
