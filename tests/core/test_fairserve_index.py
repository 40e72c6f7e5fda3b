"""FairServe's incremental waiting index (``policies/fairserve_queue.py``): the order it gives
equals a straightforward reference — recomputed from the queue at every pull — on random
queues with random interactions, retractions, aborts, finishes and clock jumps; and the
index never drifts from the queue (``check_waiting``, ``check_invariants``).
"""

from __future__ import annotations

import copy
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from test_fairserve import View  # the scheduler view FairServe reads (tests/core)

from sgl_fair.policies import make_policy
from sgl_fair.policies.fairserve import FairServe
from sgl_fair.request import Phase, Request

_rid = itertools.count()


def reference_order(policy: FairServe, waiting: list[Request], view: View, k: int) -> list[str]:
    """The first ``k`` picks, by brute force on a copy of the policy: continuing calls
    (fixed at the start of the pass) then all, each pick the request with the smallest
    (user's counter, arrival key), charged before the next pick."""
    p, waiting = copy.deepcopy((policy, waiting))
    mode = p.config.interaction_first
    live = {r.interaction_id for r in view.running}
    cont = [
        r
        for r in waiting
        if r.interaction_id is not None
        and (
            (mode == "started" and p._continues(r, view.now))
            or (mode == "running" and r.interaction_id in live)
        )
    ]
    taken: list[Request] = []
    for phase in (cont, waiting):
        while len(taken) < k:
            left = [r for r in phase if all(r is not t for t in taken)]
            if not left:
                break
            req = min(left, key=lambda r: (p.counter(r.client), r.arrival_key()))
            taken.append(req)
            p.on_admitted(req, req.input_len)
    return [r.rid for r in taken]


class Host:
    """The scheduler's side of the protocol: a queue in arrival-key order, retractions."""

    def __init__(self, policy: FairServe) -> None:
        self.policy = policy
        self.view = View()
        self.waiting: list[Request] = []

    def arrive(self, user: int, iid: int | None, n_in: int) -> None:
        req = Request(
            f"r{next(_rid)}",
            f"u{user}",
            (1,) * n_in,
            3,
            self.view.now,
            app="chat" if user % 2 else "agent",
            interaction_id=None if iid is None else f"i{user}.{iid}",
        )
        if self.policy.on_arrival(req, self.view.now) is None:
            req.phase = Phase.WAITING
            self.waiting.append(req)
            self.waiting.sort(key=Request.arrival_key)

    def admit(self, k: int, resume_unadmitted: bool) -> None:
        expected = reference_order(self.policy, self.waiting, self.view, k)
        walk = self.policy.order(tuple(self.waiting), self.view)
        got = []
        for req in walk:
            if len(got) == k:
                break
            got.append(req.rid)
            if resume_unadmitted and len(got) == 1:
                continue  # the host skipped it (SGLang may): the walk goes on without it
            self.waiting.remove(req)
            req.phase, req.admit_s = Phase.RUNNING, self.view.now
            self.policy.on_admitted(req, req.input_len if req.num_retractions == 0 else 0)
            self.view.running.append(req)
        walk.close()
        if not resume_unadmitted:
            assert got == expected
        else:
            assert sorted(got[1:]) == sorted(set(got[1:]))

    def finish(self, i: int) -> None:
        if self.view.running:
            req = self.view.running.pop(i % len(self.view.running))
            req.output_ids = [0] * req.output_len
            req.phase, req.finish_s = Phase.FINISHED, self.view.now
            self.policy.on_finished(req)

    def retract(self, i: int) -> None:
        if self.view.running:
            req = self.view.running.pop(i % len(self.view.running))
            req.phase = Phase.WAITING
            req.num_retractions += 1
            self.waiting.append(req)
            self.waiting.sort(key=Request.arrival_key)
            self.policy.on_retracted(req)

    def abort(self, i: int, waiting: bool) -> None:
        pool = self.waiting if waiting else self.view.running
        if pool:
            req = pool.pop(i % len(pool))
            req.phase, req.finish_s = Phase.ABORTED, self.view.now
            self.policy.on_aborted(req, waiting)


ARRIVE = st.tuples(
    st.just("arrive"),
    st.integers(0, 5),
    st.one_of(st.none(), st.integers(0, 3), st.integers(0, 3)),  # the user's interaction
    st.integers(1, 60),
)
OPS = st.one_of(
    ARRIVE,
    ARRIVE,
    ARRIVE,
    st.tuples(st.just("admit"), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("retract"), st.integers(0, 50)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.5, 0.5, 1.0, 1.0, 2.5, 4.0, -1.0])),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(["started", "started", "running", "off"]),
    charge=st.sampled_from(["admission", "finish"]),
    throttle=st.booleans(),
    ops=st.lists(OPS, min_size=20, max_size=120),
)
def test_incremental_order_equals_the_reference_and_the_index_never_drifts(
    mode: str, charge: str, throttle: bool, ops: list[tuple]
) -> None:
    policy = make_policy(
        "fairserve",
        interaction_first=mode,
        charge=charge,
        throttle=throttle,
        interaction_timeout_s=3.0,  # the clock jumps past it: interactions end mid-queue
        max_waiting=4,
        limits={"user_limit": 6, "window_s": 5.0},
    )
    host = Host(policy)
    for op in ops:
        kind, *args = op
        if kind == "tick":
            host.view.now = max(host.view.now + args[0], 0.0)
        elif kind == "admit":
            host.admit(args[0], resume_unadmitted=args[1] and len(host.waiting) > 1)
        else:
            getattr(host, kind)(*args)
        policy.check_waiting(host.waiting)
        policy.check_invariants()
    host.admit(len(host.waiting), resume_unadmitted=False)  # drain: the full order agrees
    assert policy.num_fallbacks == 0


def test_a_partial_queue_takes_the_reference_path_with_the_same_order() -> None:
    policy = make_policy("fairserve", throttle=False)
    host = Host(policy)
    for user in range(4):
        for i in range(3):
            host.arrive(user, user * 10 + i % 2, 10 + user)
    part = host.waiting[1:]  # e.g. the SGLang adapter's restarted walk
    ref = copy.deepcopy(policy)
    ref.incremental = False
    assert [r.rid for r in policy.order(part, host.view)] == [
        r.rid for r in ref.order(copy.deepcopy(part), host.view)
    ]
    assert policy.num_fallbacks == 1


def test_drift_is_caught_by_check_waiting() -> None:
    policy = make_policy("fairserve", throttle=False)
    host = Host(policy)
    host.arrive(0, None, 10)
    host.arrive(1, None, 10)
    host.waiting.pop()  # the host lost a request without telling the policy
    try:
        policy.check_waiting(host.waiting)
    except AssertionError:
        return
    raise AssertionError("drift not detected")
