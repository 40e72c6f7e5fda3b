"""RR — alternate RT and BE every iteration (the BROS paper's RR baseline; SPEC §5).

A batch-selecting policy (seam #1b): even iterations run the RT requests, odd ones the BE
requests (running ones decode, waiting ones are admitted in arrival order); a class with
nothing to run yields its turn to the other. No deadlines, no cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import BasePolicy, SchedulerView, register
from sgl_fair.request import Phase, Request, ServiceClass


@register("rr")
class ClassRoundRobin(BasePolicy):
    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.num_iterations = 0

    def select_batch(
        self, candidates: Sequence[Request], view: SchedulerView, cost: Callable[..., float]
    ) -> list[Request]:
        turn = ServiceClass.RT if self.num_iterations % 2 == 0 else ServiceClass.BE
        self.num_iterations += 1
        mine = [r for r in candidates if r.service_class is turn]
        if not mine:
            mine = list(candidates)
        # Running requests decode; waiting ones follow in arrival order.
        return sorted(mine, key=lambda r: (r.phase is not Phase.RUNNING, r.arrival_s, r.seq))
