"""LCF — Least Counter First: VTC without the counter lift (VTC paper's baseline).

A client that was idle keeps its low counter and, on return, monopolises the
server until it has caught up — the unfairness the counter lift exists to stop
(``vtc-dist-shift`` shows it).
"""

from __future__ import annotations

import dataclasses

from sgl_fair.policies.base import register
from sgl_fair.policies.vtc import VTC


@register("lcf")
class LCF(VTC):
    shares_running = False  # the unfair baseline stays one

    @dataclasses.dataclass(frozen=True)
    class Config(VTC.Config):
        lift: bool = False

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.lift:
                raise ValueError("lcf: lift must be False (use policy 'vtc' for the lift)")
