"""``fairserve-apps --dp N``: the single-worker run's users, N times over, on a simulated cluster.

One worker per GPU runs the row's local policy; the router dispatches with D2LPM (the
user is the client). For ``fairserve`` the router also runs FairServe's OIT over the
cluster (``router/oit.py``): a worker sees only the share of a user's calls routed to it,
so its own windows undercount the user's rate by up to N×, and only the router sees the
cluster's load. The user population is copied N times (each user's own rate unchanged),
so the cluster is as loaded as one worker is in the single-worker run. Rows are measured
as there (``fairserve_report.make_row``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.oit import ClusterOIT
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cluster import ClusterConfig, simulate_cluster

from .fairserve import GPU, KV_TOKENS, MODEL, Interaction, PolicyCase, User, _fresh, level_calls
from .fairserve_report import make_row

ROUTER = "d2lpm"


def scaled_users(users: list[User], dp: int) -> list[User]:
    """``dp`` copies of the user population (``user0042.1``, …), each user as it is: the
    cluster is offered dp× what one worker is, and no user's own rate changes (a per-user
    limit such as RPM's meets the same users as in the single-worker run)."""
    if dp == 1:
        return list(users)
    return [dataclasses.replace(u, name=f"{u.name}.{k}") for k in range(dp) for u in users]


class InteractionProgram:
    """An interaction as the cluster simulator's closed-loop program: a level's calls are
    issued when the last one's all finished; a refused call (router or worker) throttles it."""

    def __init__(self, inter: Interaction, rng: np.random.Generator, rejections: list) -> None:
        self.inter = inter
        self.start_s = inter.start_s
        self._rng = rng
        self._rejections = rejections
        self._ended = False

    @property
    def done(self) -> bool:
        return self._ended

    def start(self, now: float) -> list[Request]:
        return level_calls(self.inter, self._rng, now)

    def on_finished(self, req: Request, now: float) -> list[Request]:
        return self._settle(now)

    def on_failed(self, req: Request, now: float) -> None:
        inter = self.inter
        inter.throttled = True
        self._rejections.append((now, inter))
        self._settle(now)

    def _settle(self, now: float) -> list[Request]:
        inter = self.inter
        inter.outstanding -= 1
        if inter.outstanding:
            return []
        inter.level += 1
        if inter.throttled or inter.level == len(inter.levels):
            inter.done = not inter.throttled
            self._ended = True
            return []
        return level_calls(inter, self._rng, now)


def run_case_cluster(
    case: PolicyCase,
    interactions: list[Interaction],
    duration_s: float,
    seed: int,
    dp: int,
    scenario: str,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed + 2)
    fresh = [_fresh(i) for i in interactions]
    rejections: list[tuple[float, Interaction]] = []
    programs = [InteractionProgram(i, rng, rejections) for i in fresh]
    oit = ClusterOIT() if case.name == "fairserve" else None
    router = Router(make_router_policy(ROUTER), dp, oit=oit)
    config = ClusterConfig(
        dp=dp, gpu=GPU, model=MODEL, kv_tokens=KV_TOKENS, scheduler=SchedulerConfig()
    )
    wall0 = time.perf_counter()
    result = simulate_cluster(
        router=router,
        local_policy=lambda w: make_policy(case.name, **dict(case.options)),
        config=config,
        programs=programs,
        until_s=duration_s,
    )
    row = make_row(case.label, fresh, rejections, duration_s, time.perf_counter() - wall0)
    row["unfinished_calls"] = result.unfinished  # still in flight at the end of the run
    row["router_throttled"] = oit.num_throttled if oit is not None else 0  # calls it refused
    return {"scenario": scenario, "dp": dp, "router": ROUTER, **row}
