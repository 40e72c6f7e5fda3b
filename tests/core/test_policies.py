"""Local policies driven directly, the way the scheduler drives them.

A policy only sees requests, a small ``SchedulerView`` and accounting calls, so every
test here builds requests by hand, hands the policy a tiny real view (``FakeView``:
prefix lengths from a dict) and replays the scheduler's protocol with ``admit_walk``:
pull one request from ``order()``, charge it with ``on_admitted`` *before* pulling the
next, close the walk when the batch is full. Decoding is replayed token by token
(``decode``) exactly as ``Scheduler._emit_token`` does: append, then ``on_tokens(req, 1)``.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence

import pytest

from sgl_fair.cost import WeightedTokens
from sgl_fair.policies import Policy, Rejection, SchedulerView, make_policy, policy_names
from sgl_fair.policies.dlpm import DLPM
from sgl_fair.policies.lcf import LCF
from sgl_fair.policies.lpm import LPM
from sgl_fair.policies.rpm import RPM
from sgl_fair.policies.vtc import VTC
from sgl_fair.request import Request

W_OUT = WeightedTokens().w_out  # 2: an output token costs twice an input token


class FakeView:
    """A real, minimal ``SchedulerView``: a clock, prefix lengths by rid, a running list."""

    def __init__(
        self,
        prefix_lens: Mapping[str, int] | None = None,
        *,
        now: float = 0.0,
        running: Sequence[Request] = (),
    ) -> None:
        self._prefix_lens = dict(prefix_lens or {})
        self._now = now
        self._running = list(running)

    @property
    def now(self) -> float:
        return self._now

    def prefix_len(self, req: Request) -> int:
        return self._prefix_lens.get(req.rid, 0)

    @property
    def running(self) -> Sequence[Request]:
        return self._running


def make_req(rid: str, client: str, input_len: int, output_len: int, arrival_s: float) -> Request:
    return Request(rid, client, tuple(range(input_len)), output_len, arrival_s)


def arrive(policy, reqs: Sequence[Request], waiting: list[Request]) -> None:
    """Submit requests in order; accepted ones join ``waiting``, which is kept in arrival
    order as the scheduler keeps its queue (policies may rely on that)."""
    for r in reqs:
        if policy.on_arrival(r, r.arrival_s) is None:
            bisect.insort(waiting, r, key=Request.arrival_key)


def admit_walk(
    policy, waiting: list[Request], view: FakeView, *, limit: int | None = None
) -> list[Request]:
    """One admission walk as ``Scheduler._admit`` does it; admitted requests leave ``waiting``.

    ``limit`` plays the memory pool: the walk is closed after that many admissions.
    """
    admitted: list[Request] = []
    walk = policy.order(tuple(waiting), view)
    try:
        for req in walk:
            if limit is not None and len(admitted) >= limit:
                break
            policy.on_admitted(req, req.input_len - view.prefix_len(req))
            admitted.append(req)
    finally:
        close = getattr(walk, "close", None)
        if close is not None:
            close()
    ids = {id(r) for r in admitted}
    waiting[:] = [r for r in waiting if id(r) not in ids]
    return admitted


def decode(policy, req: Request, num_tokens: int) -> None:
    for _ in range(num_tokens):
        req.output_ids.append(0)
        policy.on_tokens(req, 1)


def longest_run(clients: Sequence[str], client: str) -> int:
    best = cur = 0
    for c in clients:
        cur = cur + 1 if c == client else 0
        best = max(best, cur)
    return best


# ------------------------------------------------------------------------------ registry


def test_fake_view_is_a_scheduler_view():
    assert isinstance(FakeView(), SchedulerView)


def test_every_registered_policy_satisfies_the_protocol():
    names = policy_names()
    assert {"fcfs", "lpm", "vtc", "lcf", "rpm", "dlpm"} <= set(names)
    for name in names:
        policy = make_policy(name)
        assert isinstance(policy, Policy), name
        assert policy.name == name
        # And it behaves like one: a lone request is accepted, walked, charged, finished.
        req = make_req(f"{name}-0", "alice", 8, 2, 0.0)
        waiting: list[Request] = []
        arrive(policy, [req], waiting)
        assert waiting == [req], name
        assert admit_walk(policy, waiting, FakeView()) == [req], name
        decode(policy, req, 2)
        policy.on_finished(req)


def test_make_policy_rejects_unknown_name_and_option():
    with pytest.raises(ValueError, match="'no-such-policy'"):
        make_policy("no-such-policy")
    with pytest.raises(ValueError, match="'quantm'"):
        make_policy("dlpm", quantm=10)
    with pytest.raises(ValueError, match="'bogus'"):
        make_policy("vtc", bogus=1)
    # Known options go through.
    assert make_policy("dlpm", quantum=10).config.quantum == 10


# ------------------------------------------------------------------------------ VTC lift


def _backlog_a_then_b_arrives(policy: VTC) -> tuple[list[Request], list[Request]]:
    """A alone for a long time (20 admissions of 100 input + 10 output tokens each), then
    B, idle so far, arrives with 10 requests while A still has 10 waiting."""
    view = FakeView()
    waiting: list[Request] = []
    arrive(policy, [make_req(f"a{i}", "a", 100, 10, float(i)) for i in range(30)], waiting)
    for req in admit_walk(policy, waiting, view, limit=20):
        decode(policy, req, 10)
    assert policy.counter("a") == 20 * (100 + W_OUT * 10)
    arrive(policy, [make_req(f"b{i}", "b", 100, 10, 100.0 + i) for i in range(10)], waiting)
    return waiting, admit_walk(policy, waiting, view, limit=10)


def test_vtc_lift_rejoining_client_cannot_burst():
    vtc = VTC()
    _, nxt = _backlog_a_then_b_arrives(vtc)
    clients = [r.client for r in nxt]
    # B's counter was lifted to A's (the only active client), so the walk alternates:
    # A first on the tie (earlier arrival), then B, then A, ...
    assert clients == ["a", "b"] * 5
    assert clients.count("b") <= 5 and longest_run(clients, "b") == 1


def test_vtc_lift_sets_counter_to_min_active_not_zero():
    vtc = VTC()
    view = FakeView()
    waiting: list[Request] = []
    # A and C are backlogged with different counters; A's is the smallest.
    arrive(vtc, [make_req(f"a{i}", "a", 100, 1, float(i)) for i in range(5)], waiting)
    arrive(vtc, [make_req(f"c{i}", "c", 300, 1, 0.5 + i) for i in range(5)], waiting)
    admit_walk(vtc, waiting, view, limit=4)  # a0 (100), c0 (300), a1 (200), a2 (300)
    assert (vtc.counter("a"), vtc.counter("c")) == (300, 300)
    admit_walk(vtc, waiting, view, limit=1)  # tie: c1 arrived before a3
    assert (vtc.counter("a"), vtc.counter("c")) == (300, 600)
    arrive(vtc, [make_req("b0", "b", 100, 1, 50.0)], waiting)
    assert vtc.counter("b") == 300  # min over active clients: not 0, not the max (600)


def test_vtc_lift_on_empty_queue_uses_last_leaver():
    vtc = VTC()
    view = FakeView()
    waiting: list[Request] = []
    arrive(vtc, [make_req("a0", "a", 500, 4, 0.0), make_req("c0", "c", 300, 4, 0.1)], waiting)
    a0, c0 = admit_walk(vtc, waiting, view)  # A (earlier) leaves first, C leaves last
    assert (a0.rid, c0.rid) == ("a0", "c0") and waiting == []
    decode(vtc, c0, 4)  # the last leaver's counter keeps moving while it decodes
    assert (vtc.counter("a"), vtc.counter("c")) == (500, 300 + W_OUT * 4)
    arrive(vtc, [make_req("b0", "b", 10, 1, 5.0)], waiting)
    assert vtc.counter("b") == vtc.counter("c") == 308


def test_vtc_lift_never_lowers_a_counter():
    vtc = VTC()
    view = FakeView()
    waiting: list[Request] = []
    arrive(vtc, [make_req("b0", "b", 1000, 1, 0.0)], waiting)
    admit_walk(vtc, waiting, view)
    arrive(vtc, [make_req(f"a{i}", "a", 100, 1, 1.0 + i) for i in range(3)], waiting)
    assert vtc.counter("a") == 1000  # lifted to the last leaver B
    admit_walk(vtc, waiting, view, limit=1)  # A: 1100, still has waiting requests
    vtc.counters["b"] = 5000.0  # B has been served far more meanwhile
    arrive(vtc, [make_req("b1", "b", 10, 1, 9.0)], waiting)
    assert vtc.counter("b") == 5000  # max(own, min active): never lowered to A's 1100


def test_lcf_has_no_lift_so_a_returning_client_bursts():
    lcf = LCF()
    waiting, nxt = _backlog_a_then_b_arrives(lcf)
    assert lcf.counter("b") == 10 * 100  # it started at 0, not at A's 2400
    # B monopolises the whole walk: A waits until B has caught up (24 admissions).
    assert [r.client for r in nxt] == ["b"] * 10
    assert any(r.client == "a" for r in waiting)


def test_lcf_rejects_lift():
    with pytest.raises(ValueError, match="lift"):
        make_policy("lcf", lift=True)


def test_vtc_weights_divide_every_charge():
    vtc = VTC(VTC.Config(weights={"heavy": 4.0}))
    waiting: list[Request] = []
    reqs = [make_req("h", "heavy", 400, 10, 0.0), make_req("l", "light", 400, 10, 0.0)]
    arrive(vtc, reqs, waiting)
    for req in admit_walk(vtc, waiting, FakeView()):
        decode(vtc, req, 10)
    assert vtc.counter("heavy") == (400 + W_OUT * 10) / 4
    assert vtc.counter("light") == 400 + W_OUT * 10


def test_vtc_order_takes_earliest_request_of_least_counter_client():
    vtc = VTC()
    waiting: list[Request] = []
    # a's requests are 3x as large as b's: after each a, b gets ~3 admissions.
    arrive(vtc, [make_req(f"a{i}", "a", 300, 1, float(i)) for i in range(4)], waiting)
    arrive(vtc, [make_req(f"b{i}", "b", 100, 1, 0.5 + i) for i in range(12)], waiting)
    order = [r.rid for r in admit_walk(vtc, waiting, FakeView(), limit=8)]
    assert order == ["a0", "b0", "b1", "b2", "a1", "b3", "b4", "b5"]


# ------------------------------------------------------------------------------ VTC prediction


def test_vtc_oracle_charges_prediction_at_admission_and_refunds_exactly():
    vtc = VTC(VTC.Config(predict="oracle"))
    req = make_req("r", "a", 100, 50, 0.0)
    waiting: list[Request] = []
    arrive(vtc, [req], waiting)
    admit_walk(vtc, waiting, FakeView())
    assert vtc.counter("a") == 100 + W_OUT * 50  # the whole output charged up front
    decode(vtc, req, 50)
    assert vtc.counter("a") == 100 + W_OUT * 50  # decoding inside the prediction is free
    vtc.on_finished(req)
    assert vtc.counter("a") == 100 + W_OUT * 50


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vtc_noisy_oracle_settles_to_actual_cost_at_finish(seed):
    vtc = VTC(VTC.Config(predict="oracle", oracle_noise=0.5, seed=seed))
    rng = random.Random(seed)
    over = under = 0
    for i in range(20):
        req = make_req(f"r{i}", "a", rng.randint(10, 200), rng.randint(5, 200), float(i))
        waiting: list[Request] = []
        arrive(vtc, [req], waiting)
        before = vtc.counter("a")
        admit_walk(vtc, waiting, FakeView())
        charged = vtc.counter("a") - before - req.input_len
        over += charged > W_OUT * req.output_len
        under += charged < W_OUT * req.output_len
        decode(vtc, req, req.output_len)
        vtc.on_finished(req)
        actual = vtc.counter("a") - before
        assert actual == pytest.approx(req.input_len + W_OUT * req.output_len, abs=1e-9)
    assert over > 0 and under > 0  # both refund and top-up paths were exercised


def _serve_one(vtc: VTC, req: Request) -> tuple[float, float]:
    """Admit, decode and finish ``req`` alone; (charge at admission, total charge).

    Charges are counted from after the arrival, so a counter lift is not included."""
    waiting: list[Request] = []
    arrive(vtc, [req], waiting)
    before = vtc.counter(req.client)
    admit_walk(vtc, waiting, FakeView())
    at_admission = vtc.counter(req.client) - before
    decode(vtc, req, req.output_len)
    vtc.on_finished(req)
    return at_admission, vtc.counter(req.client) - before


def test_vtc_predict_uses_mean_of_last_five_outputs_and_settles():
    vtc = VTC(VTC.Config(predict="predict"))
    # No history yet: nothing predicted, output charged as it is generated.
    at_admission, total = _serve_one(vtc, make_req("h0", "a", 100, 10, 0.0))
    assert (at_admission, total) == (100, 100 + W_OUT * 10)
    for i, out in enumerate((20, 30, 40, 50, 60), start=1):
        _, total = _serve_one(vtc, make_req(f"h{i}", "a", 100, out, float(i)))
        assert total == 100 + W_OUT * out
    # History 10..60: the last five average 40 (all six would give 35).
    at_admission, total = _serve_one(vtc, make_req("short", "a", 100, 25, 10.0))
    assert at_admission == 100 + W_OUT * 40
    assert total == 100 + W_OUT * 25  # 15 unused predicted tokens refunded at finish
    # History now 30, 40, 50, 60, 25: mean 41; a longer output pays the excess as it decodes.
    at_admission, total = _serve_one(vtc, make_req("long", "a", 100, 70, 11.0))
    assert at_admission == 100 + W_OUT * 41
    assert total == 100 + W_OUT * 70
    # Another client's history is its own.
    at_admission, _ = _serve_one(vtc, make_req("other", "b", 100, 5, 12.0))
    assert at_admission == 100


# ------------------------------------------------------------------------------ RPM


def test_rpm_rejects_exactly_the_request_over_the_limit():
    rpm = RPM(RPM.Config(limit=3, window_s=60.0))

    def submit(client: str, t: float) -> Rejection | None:
        return rpm.on_arrival(make_req(f"{client}@{t}", client, 4, 1, t), t)

    assert [submit("a", t) for t in (0.0, 1.0, 2.0)] == [None, None, None]
    fourth = submit("a", 3.0)
    assert isinstance(fourth, Rejection)
    assert "'a'" in fourth.reason and "3 requests" in fourth.reason
    assert fourth.retry_after_s == pytest.approx(57.0)  # when the t=0 request leaves the window
    late = submit("a", 59.0)
    assert late is not None and late.retry_after_s == pytest.approx(1.0)
    assert submit("b", 3.0) is None  # limits are per client
    # The window slid past t=0: accepted again. Had the rejected requests at 3 and 59
    # counted, this would be refused.
    assert submit("a", 60.0) is None
    assert submit("a", 60.5) is not None  # accepted ones at 1, 2, 60 fill the window
    assert submit("a", 61.0) is None  # t=1 left the window
    assert rpm.active.is_active("a")


def test_rpm_orders_fcfs():
    rpm = RPM(RPM.Config(limit=100))
    waiting: list[Request] = []
    reqs = [make_req(f"r{i}", "ab"[i % 2], 4, 1, float(i)) for i in range(6)]
    arrive(rpm, reqs, waiting)
    assert admit_walk(rpm, waiting, FakeView()) == reqs


# ------------------------------------------------------------------------------ DLPM


def _random_queue(seed: int) -> tuple[list[Request], FakeView]:
    rng = random.Random(seed)
    reqs = [
        make_req(f"r{i}", rng.choice("abc"), rng.randint(50, 400), 4, float(rng.randint(0, 5)))
        for i in range(40)
    ]
    reqs.sort(key=Request.arrival_key)  # the scheduler's queue is in arrival order
    # Few distinct prefix lengths, so ties (broken by arrival) are common.
    prefix = {r.rid: min(rng.choice((0, 0, 16, 32, 64)), r.input_len - 1) for r in reqs}
    return reqs, FakeView(prefix)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dlpm_with_huge_quantum_admits_in_lpm_order(seed):
    reqs, view = _random_queue(seed)
    lpm_order = list(LPM().order(tuple(reqs), view))
    assert [r.rid for r in lpm_order] != [r.rid for r in reqs]  # the queue is not pre-sorted
    dlpm = DLPM(DLPM.Config(quantum=1e12))
    waiting: list[Request] = []
    arrive(dlpm, reqs, waiting)
    assert admit_walk(dlpm, waiting, view) == lpm_order
    # Contrast: a small quantum interleaves clients and departs from LPM.
    small = DLPM(DLPM.Config(quantum=100))
    waiting = []
    arrive(small, reqs, waiting)
    assert admit_walk(small, waiting, view) != lpm_order


def test_dlpm_charges_extend_tokens_and_output_tokens():
    dlpm = DLPM(DLPM.Config(quantum=1000))
    waiting: list[Request] = []
    req = make_req("r", "a", 300, 5, 0.0)
    arrive(dlpm, [req], waiting)
    admit_walk(dlpm, waiting, FakeView({"r": 200}))
    assert dlpm.deficit("a") == 1000 - 100  # only the uncached 100 tokens are charged
    decode(dlpm, req, 5)
    assert dlpm.deficit("a") == 1000 - 100 - W_OUT * 5


def _indebted(config: DLPM.Config) -> DLPM:
    """A DLPM whose client 'a' has left the queue in debt (-900) and 'p' in credit (+4000)."""
    dlpm = DLPM(config)
    waiting: list[Request] = []
    arrive(dlpm, [make_req("a0", "a", 1000, 1, 0.0)], waiting)
    admit_walk(dlpm, waiting, FakeView())  # replenished to Q=100, then charged 1000
    assert dlpm.deficit("a") == 100 - 1000
    dlpm.deficits["p"] = 4000.0  # as after a large quantum and a small request
    return dlpm


def test_dlpm_rejoin_keeps_debt_by_default():
    dlpm = _indebted(DLPM.Config(quantum=100))
    dlpm.on_arrival(make_req("a1", "a", 10, 1, 5.0), 5.0)
    dlpm.on_arrival(make_req("p1", "p", 10, 1, 5.0), 5.0)
    assert dlpm.deficit("a") == -900  # min(d, 0): pausing does not erase debt
    assert dlpm.deficit("p") == 0  # ... nor can credit be hoarded
    # Only a *rejoin* clamps: a second request while still queued changes nothing.
    dlpm.deficits["a"] = 50.0
    dlpm.on_arrival(make_req("a2", "a", 10, 1, 6.0), 6.0)
    assert dlpm.deficit("a") == 50


def test_dlpm_reset_on_rejoin_is_the_papers_zero():
    dlpm = _indebted(DLPM.Config(quantum=100, reset_on_rejoin=True))
    dlpm.on_arrival(make_req("a1", "a", 10, 1, 5.0), 5.0)
    dlpm.on_arrival(make_req("p1", "p", 10, 1, 5.0), 5.0)
    assert dlpm.deficit("a") == 0
    assert dlpm.deficit("p") == 0


def test_dlpm_replenishes_all_active_clients_and_keeps_walking():
    dlpm = DLPM(DLPM.Config(quantum=100))
    view = FakeView()
    waiting: list[Request] = []
    arrive(dlpm, [make_req("a0", "a", 150, 1, 0.0), make_req("b0", "b", 150, 1, 0.0)], waiting)
    admit_walk(dlpm, waiting, view)
    assert (dlpm.deficit("a"), dlpm.deficit("b")) == (-50, -50)
    # Both are out of deficit and rejoin in debt: a walk that only admitted clients with
    # d > 0 would admit nothing. Replenishing (+Q each) lets it continue.
    arrive(dlpm, [make_req("a1", "a", 30, 1, 1.0), make_req("b1", "b", 30, 1, 1.0)], waiting)
    arrive(dlpm, [make_req("a2", "a", 30, 1, 2.0), make_req("b2", "b", 30, 1, 2.0)], waiting)
    assert (dlpm.deficit("a"), dlpm.deficit("b")) == (-50, -50)
    got = admit_walk(dlpm, waiting, view)
    # +100 -> 50 each: a1 (20), b1 (20), a2 (-10), b2 (-10): all four go through.
    assert [r.rid for r in got] == ["a1", "b1", "a2", "b2"]
    assert (dlpm.deficit("a"), dlpm.deficit("b")) == (-10, -10)


def test_dlpm_replenishes_only_when_every_active_client_is_out():
    dlpm = DLPM(DLPM.Config(quantum=100))
    view = FakeView()
    waiting: list[Request] = []
    arrive(dlpm, [make_req(f"a{i}", "a", 40, 1, float(i)) for i in range(4)], waiting)
    arrive(dlpm, [make_req(f"b{i}", "b", 40, 1, 0.5 + i) for i in range(4)], waiting)
    dlpm.deficits.update(a=100.0, b=-30.0)
    # a still has credit: it is served (past b's earlier requests) until it runs out;
    # only then does every active client get a quantum.
    got = [r.rid for r in admit_walk(dlpm, waiting, view, limit=4)]
    assert got == ["a0", "a1", "a2", "b0"]
    # a: 100 - 3*40 = -20, then +100 = 80; b: -30 + 100 = 70, then b0 -> 30.
    assert (dlpm.deficit("a"), dlpm.deficit("b")) == (80, 30)


def test_dlpm_replenish_preserves_relative_deficits():
    dlpm = DLPM(DLPM.Config(quantum=100))
    waiting: list[Request] = []
    reqs = [make_req("a0", "a", 10, 1, 0.0), make_req("b0", "b", 10, 1, 0.0)]
    arrive(dlpm, [*reqs, make_req("b1", "b", 10, 1, 0.0)], waiting)
    dlpm.deficits.update(a=-950.0, b=-330.0)
    got = admit_walk(dlpm, waiting, FakeView(), limit=1)
    # Four rounds of +100 at once (as four empty passes would): b reaches 70 first.
    assert [r.rid for r in got] == ["b0"]
    assert (dlpm.deficit("a"), dlpm.deficit("b")) == (-550, 60)
