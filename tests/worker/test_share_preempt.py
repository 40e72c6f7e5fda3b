"""The share guard's rule inside SGLang (``worker/sglang/share_preempt.py``), on requests with
SGLang's fields (priority, prompt, output, finished); the live server test
(``tests/sglang/test_live_share_guard.py``) shows SGLang preempting what it marks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sgl_fair.worker.sglang.share_preempt import SharePreemption

DEFAULT = -(2**63)  # SGLang's default priority with priority scheduling on


@dataclass(eq=False)
class Req:
    client: str
    out: int = 0
    prompt: int = 10
    priority: int = DEFAULT
    done: bool = False
    origin_input_ids: list = field(default_factory=list)
    output_ids: list = field(default_factory=list)

    def __post_init__(self):
        self.origin_input_ids = [1] * self.prompt
        self.output_ids = [2] * self.out

    def finished(self) -> bool:
        return self.done


def guard(slots=2, low_first=False, **kw) -> SharePreemption:
    return SharePreemption(lambda r: r.client, threshold=10, low_priority_first=low_first,
                           slots=slots, kv_capacity=100_000, **kw)  # fmt: skip


@pytest.mark.parametrize("low_first", [False, True])
def test_a_client_with_no_slot_marks_the_floods_least_advanced_request(low_first):
    g = guard(low_first=low_first)
    old, new = Req("flood", out=50), Req("flood", out=5)
    victim = Req("victim")
    assert g.mark(victim, [old, new]) is new
    assert victim.priority == old.priority == 0
    assert new.priority == (11 if low_first else -11)  # worse than the victim's by T + 1
    diff = (victim.priority - new.priority) * (-1 if low_first else 1)  # SGLang's test
    assert diff > 10 and (victim.priority - old.priority) == 0  # only `new` is preemptible
    g.restore()
    assert victim.priority == old.priority == new.priority == DEFAULT


def test_no_move_that_would_reverse_the_order_it_corrects():
    g = guard()
    flood, victim = Req("flood"), Req("victim")
    # one slot each: the flood's next request takes nothing from the victim (or back)
    assert g.mark(Req("flood"), [flood, victim]) is None
    assert g.mark(Req("third"), [flood, victim]) is None  # 2 slots, 3 clients: one waits
    assert flood.priority == victim.priority == DEFAULT  # nothing marked
    g4 = guard(slots=4)
    run = [Req("flood") for _ in range(3)] + [Req("victim")]
    assert g4.mark(Req("victim"), run) is not None  # 3:1 -> 2:2, level: allowed
    even = [Req("flood"), Req("flood"), Req("victim"), Req("victim")]
    assert g4.mark(Req("victim"), even) is None  # 2:2 -> 1:3 would reverse it
    assert g4.mark(Req("other"), even) is not None  # a client with none gets one


def test_weights_and_the_policys_service_measure_decide_too():
    run = [Req("heavy"), Req("heavy")]
    assert guard(weights={"heavy": 4.0}).mark(Req("light"), run) is None  # heavy's share is small
    served = {"heavy": 10.0, "light": 50.0}
    assert guard(service_received=served.__getitem__).mark(Req("light"), run) is None
    served["light"] = 5.0
    assert guard(service_received=served.__getitem__).mark(Req("light"), run) is not None


def test_nothing_is_marked_while_a_slot_is_free():
    assert guard(slots=3).mark(Req("victim"), [Req("flood"), Req("flood")]) is None
    assert guard(slots=3).mark(Req("victim"), [Req("flood"), Req("flood")], [Req("x")]) is not None


def test_finished_requests_and_strangers_hold_nothing():
    g = guard()
    done = Req("flood", done=True)
    assert g.mark(Req("victim"), [done, Req("flood")]) is None  # the flood holds one slot
    assert SharePreemption(lambda r: None, threshold=0, low_priority_first=False, slots=2,
                           kv_capacity=1).mark(Req("x"), [Req("y"), Req("y")]) is None  # fmt: skip


def test_the_routers_counts_decide_over_the_policys_local_measure():
    """Side by side with SGLang's stack the victim waited for a flood request in about half
    its calls: on its server it held one slot and the flood one, their VTC counters level, and
    the victim ahead by a request's charge as often as not. Over the cluster the flood has 24
    calls in flight to the victim's one: the router's counts (``cluster_inflight``, on the
    ledger's mirrors) decide where both are known."""
    from sgl_fair.request import Request

    mirrors: dict[int, Request] = {}

    def mirrored(r: Req, inflight: int | None, at: float) -> Req:
        m = Request(f"m{id(r)}", r.client, (1,), 1, at)
        m.cluster_inflight = inflight
        mirrors[id(r)] = m
        return r

    served = {"victim": 900.0, "flood": 800.0}  # the victim served more *here*
    run = [mirrored(Req("flood", out=9), 30, 0.0), mirrored(Req("flood", out=1), 24, 1.0)]
    g = guard(service_received=served.__getitem__, mirror=lambda r: mirrors.get(id(r)))
    assert g.mark(mirrored(Req("victim"), 1, 2.0), run) is run[1]
    assert g.mark(mirrored(Req("victim"), 24, 2.0), run) is None  # level with the flood's latest
    assert g.mark(mirrored(Req("victim"), None, 2.0), run) is None  # no count: the counter says no
    served["victim"] = 700.0
    assert g.mark(mirrored(Req("victim"), None, 2.0), run) is not None


def test_the_newcomer_is_the_waiting_client_holding_the_least_and_owed_a_slot():
    """Every slot taken: of each waiting client's earliest request, the one whose client holds
    the smallest share, if it is owed a slot (then marked for); with a free slot, none."""
    run = [Req("flood", out=9), Req("flood", out=1)]
    light, flood_next = Req("light"), Req("flood")
    g = guard()
    assert g.newcomer({"flood": flood_next, "light": light}, run) is light
    assert run[0].priority == 0 and run[1].priority == -11  # the least advanced marked
    g.restore()
    assert guard(slots=3).newcomer({"light": light}, run) is None  # a free slot: no newcomer
    served = {"light": 50.0, "flood": 10.0}.__getitem__
    assert guard(service_received=served).newcomer({"light": light}, run) is None  # not owed
    half = [Req("flood"), Req("light")]
    assert guard().newcomer({"light": Req("light"), "flood": Req("flood")}, half) is None


def test_waiting_set_earliest_per_client():
    from sgl_fair.request import Request
    from sgl_fair.worker.sglang.waiting_set import WaitingSet

    w = WaitingSet()
    a1, b1, a2 = (Request(rid, c, (1,), 1, t) for rid, c, t in
                  (("a1", "a", 0.0), ("b1", "b", 1.0), ("a2", "a", 2.0)))  # fmt: skip
    for m in (a2, b1):
        w.add(m)
    w.add(a1)  # back out of order (a retraction)
    assert w.earliest() == {"a": a1, "b": b1}
    w.remove(a1)
    assert w.earliest() == {"a": a2, "b": b1}
