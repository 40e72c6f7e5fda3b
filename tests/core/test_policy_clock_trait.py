"""A policy whose order reads the clock declares it (``orders_by_time``); one whose order asks
prefix lengths declares that (``asks_prefix_len``: the SGLang plugin keeps its shadow of the
cache, and drains KV events into it every pass, only for those).

Hosts rely on the flag: the SGLang plugin's rank clock ticks every scheduler iteration only for
such a policy (otherwise only when requests were pulled, saving a collective per iteration on
TP > 1), so an order that reads ``view.now`` undeclared would see a stale time.
"""

from __future__ import annotations

import pytest

from sgl_fair.policies import PolicyTraits, make_policy, policy_class, policy_names
from sgl_fair.request import Request, ServiceClass


class ClockCountingView:
    def __init__(self) -> None:
        self.reads = 0
        self.prefix_reads = 0
        self.running: list[Request] = []

    @property
    def now(self) -> float:
        self.reads += 1
        return 10.0

    def prefix_len(self, req: Request) -> int:
        self.prefix_reads += 1
        return 0


def _requests() -> list[Request]:
    out = []
    for i in range(6):
        r = Request(f"r{i}", f"c{i % 3}", tuple(range(20 + i)), 8, arrival_s=float(i) / 10)
        if i % 2:
            r.service_class = ServiceClass.RT
            r.ttft_slo_s, r.tpot_slo_s = 1.0, 0.1
        out.append(r)
    return out


@pytest.mark.parametrize("name", policy_names())
def test_an_order_that_reads_the_clock_declares_it(name: str) -> None:
    policy = make_policy(name)
    waiting = [r for r in _requests() if policy.on_arrival(r, r.arrival_s) is None]
    view = ClockCountingView()
    for req in policy.order(waiting, view):
        policy.on_admitted(req, req.input_len)
    declared = PolicyTraits.of(policy_class(name)).orders_by_time
    assert declared == (view.reads > 0), f"{name}: {view.reads} reads of now, declared {declared}"


@pytest.mark.parametrize(
    ("name", "opts"),
    [(n, {}) for n in policy_names()] + [("bros", {"inner": "dlpm"}), ("bros", {"inner": "vtc"})],
)
def test_an_order_that_asks_prefix_lengths_declares_it(name: str, opts: dict) -> None:
    policy = make_policy(name, **opts)
    waiting = [r for r in _requests() if policy.on_arrival(r, r.arrival_s) is None]
    view = ClockCountingView()
    for req in policy.order(waiting, view):
        policy.on_admitted(req, req.input_len)
    declared = PolicyTraits.of(policy_class(name)).asks_prefix_len
    assert view.prefix_reads == 0 or declared, f"{name} asks prefix_len undeclared"
    if not opts:  # the options that turn matching on or off aside, the flag is exact
        assert declared == (view.prefix_reads > 0) or name == "bros", name
