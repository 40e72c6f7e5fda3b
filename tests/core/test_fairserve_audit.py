"""FairServe defects found by the audit of issue 31, each pinned by a test.

* ``T_g`` is the user's limit over *all* its apps (SPEC §4: the global per-user limit);
* an interaction with a call queued or running is never idle, however long that call takes;
* ``charge="admission"``: no user keeps credit below the floor a newcomer was lifted to.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.policies import make_policy
from tests.core.test_fairserve import Driver, call


def test_the_global_user_limit_counts_the_user_over_all_its_apps() -> None:
    """One user over 4 apps, ``T_g = 3``, overloaded: 3 new interactions in, not 12."""
    p = make_policy("fairserve", max_waiting=0, limits={"user_limit": 3, "window_s": 60})
    d = Driver(p)
    d.arrive(call("x", app="other"))  # one waiting: overloaded from now on
    accepted = 0
    for i in range(4):
        for app in ("chat", "agent", "tot", "judge"):
            d.view.now += 0.1
            accepted += d.arrive(call("u", app=app, iid=f"{app}-{i}"))
    assert accepted == 3
    rej = d.rejected[0].reject_reason
    assert "user 'u' over its limit of 3 requests per 60 s" in rej


def test_a_per_app_user_limit_counts_that_app_only() -> None:
    """``user_limits[app]`` (beyond the paper) counts the user's calls of that app only."""
    p = make_policy("fairserve", max_waiting=0, limits={"user_limits": {"chat": 2, "agent": 2}})
    d = Driver(p)
    d.arrive(call("x", app="other"))
    got = [d.arrive(call("u", app=a, iid=f"{a}{i}")) for i in range(3) for a in ("chat", "agent")]
    assert got == [True, True, True, True, False, False]


def _overloaded_over_limit(**opts):
    """A policy that is overloaded and whose user ``u`` is at its limit of 1."""
    p = make_policy(
        "fairserve",
        max_waiting=0,
        interaction_timeout_s=120,
        limits={"user_limit": 1, "window_s": 1000},
        **opts,
    )
    d = Driver(p)
    d.arrive(call("x", app="other"))  # one waiting: overloaded from now on
    return p, d


def test_a_call_running_longer_than_the_timeout_keeps_its_interaction_alive() -> None:
    p, d = _overloaded_over_limit()
    d.arrive(call("u", iid="i"))
    d.admit(2)  # x and u's first call run ...
    d.arrive(call("x", app="other"))  # (still overloaded)
    d.view.now = 300.0  # ... for 300 s; no arrival, admission or finish since 0 s
    assert d.arrive(call("u", iid="i", stage=1)), "429 mid-interaction"
    assert not d.arrive(call("u", iid="new"))  # a new one is still throttled


def test_a_call_waiting_longer_than_the_timeout_keeps_its_interaction_alive() -> None:
    p, d = _overloaded_over_limit()
    d.arrive(call("u", iid="i"))  # waits: never admitted
    d.view.now = 300.0
    assert d.arrive(call("u", iid="i", stage=1)), "429 mid-interaction"
    assert p.in_flight("i", 300.0)


def test_an_interaction_ends_a_timeout_after_its_last_open_call_finished() -> None:
    p, d = _overloaded_over_limit()
    d.arrive(call("u", iid="i"))
    (first,) = [r for r in d.admit(2) if r.client == "u"]
    d.arrive(call("x", app="other"))
    d.view.now = 300.0
    d.finish(first)
    d.view.now = 419.0
    assert p.in_flight("i", 419.0)
    d.view.now = 421.0
    assert not p.in_flight("i", 421.0)
    assert not d.arrive(call("u", iid="i", stage=1))  # idle 121 s: it starts anew, throttled


def test_an_aborted_waiting_call_closes() -> None:
    p, d = _overloaded_over_limit()
    req = call("u", iid="i")
    d.arrive(req)
    d.waiting.remove(req)
    p.on_aborted(req, waiting=True)
    d.view.now = 200.0
    assert not p.in_flight("i", 200.0)


def test_admission_charging_leaves_no_credit_below_a_newcomers_floor() -> None:
    """A's pre-charged expected output must not become the floor a newcomer is lifted to,
    only for A's refund to leave A below it (credit over the newcomer)."""
    p = make_policy("fairserve", throttle=False, stage_weights={"chat": 20.0}, learn=False)
    d = Driver(p)
    first, second = call("a", n_in=10, n_out=5), call("a", n_in=10, n_out=5)
    first.max_new_tokens = second.max_new_tokens = 190  # pre-charged: (10 + 190) / 20 = 10
    d.arrive(first)
    d.arrive(second)
    d.admit(1)
    d.arrive(call("b"))  # b (re)joins: lifted to the floor
    floor = p.counter("b")
    d.finish(first)  # settled: (10 + 5) / 20 = 0.75
    assert p.counter("a") >= floor, (p.counter("a"), floor)


_op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 4), st.integers(1, 200)),
    st.tuples(st.just("admit"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(_op, min_size=1, max_size=80), st.sampled_from(["admission", "finish"]))
def test_no_backlogged_user_falls_below_a_floor_issued_before(ops, charge) -> None:
    """Floors never fall, and once one is issued every backlogged user stays at or above it:
    a refund never leaves a user credit below the floor someone was lifted to."""
    p = make_policy("fairserve", throttle=False, interaction_first="off", charge=charge)
    d = Driver(p)
    floor = 0.0
    for t, (kind, a, b) in enumerate(ops):
        d.view.now = float(t)
        if kind == "arrive":
            req = call(f"u{a}", n_in=20, n_out=b)
            req.max_new_tokens = 200  # (pre-)charged for up to 200, settles to b
            before = p.counter(req.client)
            d.arrive(req)
            if p.counter(req.client) > before:  # lifted: to the floor
                assert p.counter(req.client) >= floor - 1e-9, "the floor fell"
                floor = p.counter(req.client)
        elif kind == "admit":
            d.admit(a)
        elif d.view.running:
            d.finish(d.view.running[a % len(d.view.running)])
        for c in d.backlogged():
            assert p.counter(c) >= floor - 1e-9, (c, p.counter(c), floor)
        p.check_invariants()
