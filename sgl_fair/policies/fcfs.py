"""FCFS: admit in arrival order (SGLang's ``fcfs``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import BasePolicy, SchedulerView, register
from sgl_fair.request import Request


@register("fcfs")
class FCFS(BasePolicy):
    @dataclass(frozen=True)
    class Config:
        pass

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        # The scheduler keeps `waiting` in arrival order already.
        return iter(list(waiting))
