"""FairServe (SPEC §4): WSC's costs, learned weights, selection and bound; OIT's rules.

Pure core tests: a tiny driver plays the scheduler's side of the policy protocol (arrive,
admission walk, finish), so every property is checked against the policy alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.policies import make_policy
from sgl_fair.policies.fairserve import FairServe
from sgl_fair.policies.fairserve_oit import Limits
from sgl_fair.request import Phase, Request

DETERMINISTIC = settings(max_examples=150, deadline=None, derandomize=True)
_rid = itertools.count()


def call(
    user: str,
    *,
    n_in: int = 10,
    n_out: int = 5,
    app: str | None = "chat",
    stage: int = 0,
    iid: str | None = None,
    t: float = 0.0,
) -> Request:
    return Request(
        f"r{next(_rid)}",
        user,
        (1,) * n_in,
        n_out,
        t,
        app=app,
        stage=stage,
        interaction_id=iid,
    )


@dataclass
class View:
    now: float = 0.0
    running: list[Request] = field(default_factory=list)

    def prefix_len(self, req: Request) -> int:
        return 0


class Driver:
    """The scheduler's side of the protocol, without memory limits."""

    def __init__(self, policy: FairServe) -> None:
        self.policy = policy
        self.view = View()
        self.waiting: list[Request] = []
        self.rejected: list[Request] = []

    def arrive(self, req: Request) -> bool:
        req.arrival_s = self.view.now
        rejection = self.policy.on_arrival(req, self.view.now)
        if rejection is not None:
            req.phase, req.reject_reason = Phase.REJECTED, rejection.reason
            self.rejected.append(req)
            return False
        self.waiting.append(req)
        return True

    def admit(self, k: int) -> list[Request]:
        walk = self.policy.order(tuple(self.waiting), self.view)
        out = []
        for req in itertools.islice(walk, k):
            self.waiting.remove(req)
            req.phase, req.admit_s = Phase.RUNNING, self.view.now
            self.policy.on_admitted(req, req.input_len)
            self.view.running.append(req)
            out.append(req)
        walk.close()
        return out

    def finish(self, req: Request) -> None:
        req.output_ids = [0] * req.output_len
        self.policy.on_tokens(req, req.output_len)
        req.phase, req.finish_s = Phase.FINISHED, self.view.now
        self.view.running.remove(req)
        self.policy.on_finished(req)

    def backlogged(self) -> set[str]:
        return {r.client for r in self.waiting}


# ---------------------------------------------------------------- registry and costs


def test_both_names_register_and_fairserve_w_never_throttles() -> None:
    assert make_policy("fairserve").config.throttle
    w = make_policy("fairserve-w", max_waiting=0, limits={"user_limit": 1})
    d = Driver(w)
    assert all(d.arrive(call("u")) for _ in range(20))


def test_cost_is_alpha_input_beta_system_gamma_output_over_stage_weight_times_priority() -> None:
    p = make_policy(
        "fairserve",
        alpha=1,
        beta=2,
        gamma=3,
        system_lens={"chat": 4},
        stage_weights={"chat/0": 100.0},
        priority={"vip": 0.5},
    )
    req = call("vip", n_in=10, n_out=5)
    # L_S = 4, L_I = 6, L_O = 5: 1*6 + 2*4 + 3*5 = 29; over w = 100; times E = 0.5
    assert p.raw_cost(req, 5) == 29
    assert p.service(req, 5) == pytest.approx(0.145)
    assert p.service(call("other", n_in=10), 5) == pytest.approx(0.29)


def test_app_seed_covers_every_stage_and_a_stage_seed_wins() -> None:
    p = make_policy("fairserve", stage_weights={"agent": 50.0, "agent/2": 10.0})
    assert p.stage_weight(call("u", app="agent", stage=1)) == 50.0
    assert p.stage_weight(call("u", app="agent", stage=2)) == 10.0
    assert p.stage_weight(call("u", app="judge")) is None


def test_stage_weights_are_learned_online_as_a_running_mean() -> None:
    p = make_policy("fairserve", stage_weights={"tot/1": 100.0}, seed_count=2, throttle=False)
    d = Driver(p)
    costs = []
    for n_in, n_out in ((30, 10), (50, 30), (20, 20)):
        d.arrive(call("u", app="tot", stage=1, n_in=n_in, n_out=n_out))
        (req,) = d.admit(1)
        d.finish(req)
        costs.append(p.raw_cost(req, n_out))
    # Seed worth 2 observations, then the three finished calls.
    assert p.stage_weight(call("u", app="tot", stage=1)) == pytest.approx((200 + sum(costs)) / 5)
    # An unseeded stage learns from its first call; its first call costs exactly 1.
    d.arrive(call("v", app="new", n_in=40, n_out=8))
    before = p.counter("v")
    (req,) = d.admit(1)
    d.finish(req)
    assert p.counter("v") - before == pytest.approx(1.0)
    assert p.stage_weight(call("v", app="new")) == pytest.approx(48.0)


def test_learning_can_be_turned_off() -> None:
    p = make_policy("fairserve", stage_weights={"chat": 7.0}, learn=False, throttle=False)
    d = Driver(p)
    d.arrive(call("u", n_in=100))
    d.finish(d.admit(1)[0])
    assert p.stage_weight(call("u")) == 7.0


@pytest.mark.parametrize("charge", ["admission", "finish"])
def test_settled_charge_is_the_true_cost_in_both_modes(charge: str) -> None:
    p = make_policy("fairserve", charge=charge, stage_weights={"chat": 20.0}, learn=False)
    d = Driver(p)
    req = call("u", n_in=10, n_out=5)
    req.max_new_tokens = 50  # admission charges the expected output (50), finish settles to 5
    d.arrive(req)
    d.admit(1)
    assert p.counter("u") == pytest.approx(60 / 20 if charge == "admission" else 0.0)
    d.finish(req)
    assert p.counter("u") == pytest.approx(15 / 20)


def test_bad_options_are_one_line_errors() -> None:
    for opts in ({"charge": "never"}, {"interaction_first": "x"}, {"priority": {"u": 0}}):
        with pytest.raises(ValueError, match="fairserve"):
            make_policy("fairserve", **opts)


# ---------------------------------------------------------------- selection


def test_least_served_user_goes_first_and_a_rejoining_user_is_lifted() -> None:
    p = make_policy("fairserve", throttle=False, interaction_first="off")
    d = Driver(p)
    for _ in range(3):
        d.arrive(call("heavy"))
    d.finish(d.admit(1)[0])
    d.arrive(call("light"))
    assert p.counter("light") == pytest.approx(p.counter("heavy"))  # lifted, no banked credit
    first = d.admit(1)[0]
    assert first.client in ("heavy", "light")
    second = d.admit(1)[0]
    assert {first.client, second.client} == {"heavy", "light"}


def test_calls_of_in_flight_interactions_go_first() -> None:
    p = make_policy("fairserve", throttle=False)
    d = Driver(p)
    d.arrive(call("agent", iid="i1", app="agent"))
    d.finish(d.admit(1)[0])  # the agent's interaction is now in flight, its counter > 0
    d.arrive(call("chatter", iid="c1"))  # a new interaction of a less-served user
    d.arrive(call("agent", iid="i1", app="agent", stage=1))  # the agent's next call
    assert d.admit(1)[0].interaction_id == "i1"
    off = make_policy("fairserve", throttle=False, interaction_first="running")
    d = Driver(off)
    d.arrive(call("agent", iid="i1", n_in=100))
    d.finish(d.admit(1)[0])  # finished: not in the running batch any more
    d.arrive(call("chatter", iid="c1"))
    d.arrive(call("agent", iid="i1", stage=1))
    assert d.admit(1)[0].client == "chatter"  # the paper's rule: least-served user first


# ---------------------------------------------------------------- WSC's bound (property)

_SHAPES = [  # (app, stage, input, output): one fixed output length per app stage
    ("chat", 0, 40, 20),
    ("agent", 0, 300, 10),
    ("agent", 1, 500, 60),
    ("judge", 0, 2000, 200),
]
_op = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 4), st.integers(0, len(_SHAPES) - 1)),
    st.tuples(st.just("admit"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
)


@DETERMINISTIC
@given(st.lists(_op, min_size=1, max_size=80))
def test_wsc_counters_of_backlogged_users_stay_within_one_max_request(ops) -> None:
    """VTC's lift bound for WSC: no backlogged user's counter falls more than one request's
    charge below another's, whatever the users' priorities, apps and sizes."""
    p = make_policy(
        "fairserve",
        throttle=False,
        interaction_first="off",
        priority={"u0": 1.0, "u1": 2.0, "u2": 0.5, "u3": 1.0, "u4": 3.0},
        stage_weights={"agent": 250.0, "judge/0": 9000.0},
    )
    d = Driver(p)
    max_charge = 0.0
    for t, (kind, a, b) in enumerate(ops):
        d.view.now = float(t)
        if kind == "arrive":
            app, stage, n_in, n_out = _SHAPES[b]
            req = call(f"u{a}", app=app, stage=stage, n_in=n_in, n_out=n_out)
            rejoining = req.client not in d.backlogged()
            others = d.backlogged() - {req.client}
            floor = min((p.settled(c) for c in others), default=None)
            old = p.counter(req.client)
            d.arrive(req)
            if rejoining and floor is not None:  # the lift, to the least settled active counter
                assert p.counter(req.client) == max(old, floor)
        elif kind == "admit":
            for _ in range(a):
                least = min((p.counter(c) for c in d.backlogged()), default=None)
                before = {c: p.counter(c) for c in d.backlogged()}
                got = d.admit(1)
                if not got:
                    break
                assert p.counter(got[0].client) >= 0
                assert before[got[0].client] == pytest.approx(least)  # least-served first
                max_charge = max(max_charge, p.counter(got[0].client) - before[got[0].client])
        elif d.view.running:
            d.finish(d.view.running[a % len(d.view.running)])
        p.check_invariants()
        counters = [p.counter(c) for c in d.backlogged()]
        if counters:
            assert max(counters) - min(counters) <= max_charge + 1e-9, (counters, max_charge)


# ---------------------------------------------------------------- OIT (property)


class Load:
    def __init__(self) -> None:
        self.kv = 0.0

    def __call__(self) -> float:
        return self.kv


_oit_op = st.tuples(
    st.integers(0, 5),  # user (u0 is the abuser: it sends most)
    st.booleans(),  # True: continue the user's current interaction, if it has one
    st.sampled_from([0.0, 0.5, 0.95]),  # KV usage at this arrival
    st.integers(0, 2),  # requests admitted before it
)


@DETERMINISTIC
@given(st.lists(_oit_op, min_size=1, max_size=120))
def test_oit_throttles_only_new_interactions_and_only_when_overloaded(ops) -> None:
    p = make_policy(
        "fairserve", max_waiting=8, kv_threshold=0.9, limits={"user_limit": 3, "window_s": 30}
    )
    load = Load()
    p.attach_load(load)
    d = Driver(p)
    current: dict[str, str] = {}
    arrivals: dict[str, list[float]] = {}  # every arrival counts, throttled ones too
    for t, (u, cont, kv, n_admit) in enumerate(ops):
        d.view.now = now = t * 0.5
        load.kv = kv
        d.admit(n_admit)
        user = f"u{u}"
        continuing = cont and user in current
        iid = current[user] if continuing else f"{user}-{t}"
        overloaded = p.overloaded()
        ok = d.arrive(call(user, iid=iid))
        times = arrivals.setdefault(user, [])
        times.append(now)
        in_window = sum(1 for x in times if x > now - 30)
        if overloaded and not continuing and in_window > 3:
            assert not ok, f"{user}: {in_window} calls in the window, a new interaction let in"
        if not ok:
            assert overloaded, "throttled while not overloaded"
            assert not continuing, "throttled mid-interaction"
            assert d.rejected[-1].phase is Phase.REJECTED
        else:
            current[user] = iid
        p.check_invariants()


def test_oit_rejects_with_a_reason_and_retry_after_user_limit_before_app_limit() -> None:
    p = make_policy(
        "fairserve",
        max_waiting=0,
        limits={"user_limit": 2, "app_limits": {"chat": 100}, "window_s": 60},
    )
    d = Driver(p)
    d.arrive(call("x"))  # one waiting: overloaded from now on
    d.view.now = 1.0
    assert d.arrive(call("u", iid="a"))
    d.view.now = 2.0
    assert d.arrive(call("u", iid="b"))
    d.view.now = 3.0
    rej = p.on_arrival(call("u", iid="c"), 3.0)
    assert rej is not None and "user 'u'" in rej.reason
    # Throttled arrivals count too: a retry fits once the 1 s and 2 s requests expire (62 s).
    assert rej.retry_after_s == pytest.approx(59.0)
    assert p.on_arrival(call("u", iid="a"), 4.0) is None  # mid-interaction: never throttled
    q = make_policy(
        "fairserve", max_waiting=0, limits={"user_limit": 100, "app_limits": {"chat": 2}}
    )
    d = Driver(q)
    for i in range(3):
        d.arrive(call(f"v{i}", iid=f"v{i}"))
    assert [r.client for r in d.rejected] == ["v2"]
    assert "app 'chat'" in d.rejected[0].reject_reason


def test_oit_derives_user_limits_per_app_from_history() -> None:
    p = make_policy("fairserve", max_waiting=10_000, limits=Limits(limit_factor=2, min_limit=3))
    d = Driver(p)
    for t in range(30):  # 20 benign users, 1 request every 6 s -> 5 per minute; one abuser
        d.view.now = t * 3.0
        for i in range(10):
            d.arrive(call(f"b{(t % 2) * 10 + i}", iid=f"b{t}-{i}"))
        for _ in range(5):
            d.arrive(call("abuser", iid=f"x{t}-{_}"))
    assert not d.rejected  # never while not overloaded
    limit = p.windows.user_limit("chat")
    assert 2 * 9 <= limit <= 2 * 11  # 2 x the median benign user's 10 per minute
    assert p.windows.user_count("abuser", "chat", d.view.now) > limit
    assert p.windows.over_limit("abuser", "chat", d.view.now) is not None
    assert p.windows.over_limit("b1", "chat", d.view.now) is None


def test_the_worker_gives_oit_its_kv_usage():
    """The scheduler hands a policy with ``attach_load`` its KV usage, live and in the sim."""
    from sgl_fair.worker.sim.cost_model import CostModel
    from sgl_fair.worker.sim.runner import make_sim_worker

    sched, _ = make_sim_worker(
        policy=make_policy("fairserve"),
        cost_model=CostModel.from_names("H100", "Llama-3.1-8B"),
        kv_tokens=4_000,
    )
    probe = sched.policy._load
    assert probe is not None and probe() == 0.0
    req = Request("r", "u", tuple(range(1_000)), output_len=8, arrival_s=0.0)
    sched.add_request(req, 0.0)
    sched.step(0.0)
    assert 0.2 <= probe() <= 0.3  # 1,000 prompt tokens + reservation of a 4,000-token pool


def test_oit_limit_zero_throttles_every_new_interaction_and_negative_is_refused() -> None:
    p = make_policy("fairserve", max_waiting=0, limits={"user_limit": 0, "window_s": 30})
    d = Driver(p)
    d.arrive(call("x"))  # one waiting: overloaded from now on
    rej = p.on_arrival(call("u", iid="a"), 1.0)
    assert rej is not None and rej.retry_after_s == pytest.approx(30.0)
    with pytest.raises(ValueError, match="limits must be >= 0"):
        make_policy("fairserve", limits={"app_limits": {"chat": -1}})
    with pytest.raises(ValueError, match="window_s"):
        make_policy("fairserve", limits={"window_s": 0})


def test_per_app_state_is_bounded_however_many_app_names_clients_send() -> None:
    """Apps and stages come from clients: a client naming a new app (or stage) on every call
    must not grow the policy's memory for the server's lifetime. Past ``MAX_APPS`` apps (and
    ``MAX_STAGES`` learned stages) the least recently seen is forgotten; a busy app is not."""
    from sgl_fair.policies.fairserve import MAX_STAGES
    from sgl_fair.policies.fairserve_oit import MAX_APPS

    p = make_policy("fairserve", max_waiting=0, limits={"window_s": 1.0, "refresh_s": 0.5})
    d = Driver(p)
    n = MAX_APPS + MAX_STAGES + 500
    for i in range(n):
        d.view.now = i * 0.01
        for app in (f"junk{i}", "chat"):  # "chat" keeps calling between the junk
            req = call("u", app=app, stage=i % 3)
            assert d.arrive(req) or req.reject_reason
            if req in d.waiting:
                d.admit(len(d.waiting))
                d.finish(req)
    assert p.windows.apps_held() <= MAX_APPS
    assert p.learned_stages() <= MAX_STAGES
    assert p.windows.app_limit("chat") is not None  # the busy app kept its history
    assert p.stage_weight(call("u", app="chat", stage=0)) is not None
