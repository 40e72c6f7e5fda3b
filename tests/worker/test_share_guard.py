"""The share guard (worker/share_guard.py): a flood cannot hold the running batch while a
well-behaved client waits, without ping-pong, lost work or wrong counters.

Everything runs the real ``Scheduler`` over a real radix cache and the roofline engine in
virtual time; ``drive`` checks KV conservation and the scheduler's invariants at every state.
"""

from __future__ import annotations

import pytest
from conftest import assert_finished_exactly, drive, unique_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.launch.config import parse_config, share_guard_on
from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.token import TokenAllocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine

COST = CostModel.from_names("H100", "Llama-3.1-8B")
CAPACITY = 40_000


def scheduler(
    policy: str = "vtc", *, guard: bool, capacity: int = CAPACITY, ratio: float = 0.7, **opts
) -> Scheduler:
    kv = PrefixKVCache(TokenAllocator(capacity))
    cfg = SchedulerConfig(share_guard=guard, max_running_requests=64, init_new_token_ratio=ratio)
    return Scheduler(policy=make_policy(policy, **opts), kv=kv, config=cfg)


def flood_then_probe(
    guard: bool, policy: str = "vtc", a_prompt: int = 16, **opts
) -> tuple[Request, Scheduler]:
    """B fills the pool with 2k-token prompts / 400-token outputs; A sends one request at 3 s."""
    b = [Request(f"b{i}", "B", unique_tokens(2000), 400, 0.0) for i in range(40)]
    a = Request("a", "A", unique_tokens(a_prompt), 16, 3.0)
    sched = scheduler(policy, guard=guard, **opts)
    full = []

    def watch(s: Scheduler, now: float) -> None:
        if now < 3.0:
            full.append(s.kv_usage())

    drive(sched, SimEngine(COST), [*b, a], before_step=watch)
    assert max(full) > 0.9, "the flood must fill the KV pool before A arrives"
    assert_finished_exactly([*b, a])
    return a, sched


def ttft(req: Request) -> float:
    assert req.first_token_s is not None
    return req.first_token_s - req.arrival_s


def test_a_small_request_is_not_stuck_behind_the_floods_blocked_head() -> None:
    """A's 16 tokens fit; B's next 2k-token prompt does not, and VTC's walk (A lifted to B's
    counter, B's request older) stops there, as SGLang's does. The guard admits the
    least-sharing client's request past it. (DLPM's walk skips B, out of deficit, by itself.)"""
    a_off, off = flood_then_probe(False)
    a_on, on = flood_then_probe(True)
    assert ttft(a_off) > 1.0, "without the guard A waits for one of B's decodes to finish"
    assert ttft(a_on) < 0.1, f"with the guard A's first token comes within a step or two: {a_on}"
    assert on.stats.num_share_retractions == off.stats.num_share_retractions == 0


@pytest.mark.parametrize("policy", ["vtc", "dlpm", "fairserve"])
def test_a_request_that_needs_room_takes_it_from_the_flood(policy: str) -> None:
    """A's 1,500-token prompt does not fit: B's running requests are retracted for it."""
    a_off, off = flood_then_probe(False, policy, a_prompt=1500)
    a_on, on = flood_then_probe(True, policy, a_prompt=1500)
    assert ttft(a_off) > 1.0
    assert ttft(a_on) < 0.2, a_on
    assert on.stats.num_share_retractions >= 1
    assert off.stats.num_share_retractions == 0


def test_the_flood_loses_little_and_its_counter_is_charged_once() -> None:
    a_on, on = flood_then_probe(True, a_prompt=1500)
    _, off = flood_then_probe(False, a_prompt=1500)
    # One B request retracted for A: its output is recomputed, nothing else.
    assert on.stats.num_share_retractions <= 2
    assert on.stats.num_prefill_tokens <= off.stats.num_prefill_tokens + 2 * 2400
    # VTC charges B each input once and each output token once, retraction or not.
    b_charged = 40 * 2000 * 1.0 + 40 * 400 * 2.0
    assert on.policy.counter("B") == pytest.approx(b_charged)
    assert off.policy.counter("B") == pytest.approx(b_charged)


def test_weights_set_the_share_a_client_may_keep() -> None:
    """B with weight 40 may hold 40x A's share: A (weight 1) cannot take B's requests away."""
    a, sched = flood_then_probe(True, a_prompt=1500, weights={"B": 40.0})
    assert sched.stats.num_share_retractions == 0
    assert ttft(a) > 1.0


def test_decode_pressure_retracts_from_the_client_holding_the_most() -> None:
    """Two clients' decodes outgrow the pool: only the larger holder is retracted."""
    big = [Request(f"b{i}", "B", unique_tokens(1500), 600, 0.0) for i in range(12)]
    small = [Request(f"s{i}", "S", unique_tokens(200), 600, 0.0) for i in range(2)]
    sched = scheduler("fcfs", guard=True, capacity=20_000, ratio=0.1)
    retracted: list[str] = []
    original = sched.retraction.retract

    def spy(req: Request) -> None:
        retracted.append(req.client)
        original(req)

    sched.retraction.retract = spy  # type: ignore[method-assign]
    drive(sched, SimEngine(COST), [*big, *small])
    assert retracted and set(retracted) == {"B"}
    assert_finished_exactly([*big, *small])


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("ABC"),
            st.integers(1, 3000),  # prompt
            st.integers(1, 300),  # output
            st.floats(0, 5),  # arrival
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from(["vtc", "dlpm", "fairserve", "fcfs"]),
)
def test_any_workload_finishes_exactly_with_the_guard(specs, policy) -> None:
    """Random clients, sizes and arrivals on a small pool: every request finishes with its
    exact output, and KV and scheduler invariants hold at every state (``drive``)."""
    reqs = [Request(f"r{i}", c, unique_tokens(p), o, t) for i, (c, p, o, t) in enumerate(specs)]
    sched = scheduler(policy, guard=True, capacity=8_000)
    drive(sched, SimEngine(COST), reqs)
    assert_finished_exactly(reqs)


def test_two_equal_floods_do_not_take_turns_preempting() -> None:
    """A and B flood alike, B a little later: B is let in up to an equal share, then the
    two run side by side; the guard never bounces requests back and forth."""
    a = [Request(f"a{i}", "A", unique_tokens(2000), 300, 0.0) for i in range(30)]
    b = [Request(f"b{i}", "B", unique_tokens(2000), 300, 1.0) for i in range(30)]
    sched = scheduler("vtc", guard=True)
    drive(sched, SimEngine(COST), [*a, *b])
    assert_finished_exactly([*a, *b])
    # Equalising takes about half of A's running requests once; nothing beyond that.
    assert 1 <= sched.stats.num_share_retractions <= 12


def test_launcher_turns_the_guard_on_for_fair_policies_only() -> None:
    on = {p: share_guard_on(parse_config(["--schedule-policy", p])) for p in
          ("vtc", "dlpm", "fairserve", "fcfs", "lpm", "lcf", "rpm")}  # fmt: skip
    assert on == {"vtc": True, "dlpm": True, "fairserve": True, "fcfs": False, "lpm": False,
                  "lcf": False, "rpm": False}  # fmt: skip
    assert not share_guard_on(parse_config(["--schedule-policy", "vtc", "--share-guard", "off"]))
    assert share_guard_on(parse_config(["--schedule-policy", "fcfs", "--share-guard", "on"]))


def _served_more_here(cluster: tuple[int, int] | None) -> tuple[Request, Scheduler]:
    """A has been served far more than B *here* (its VTC counter ahead), and A's 1,500-token
    prompt needs room from B's running flood; ``cluster``: (A's, B's) calls in flight over the
    cluster as the router counted them at dispatch (None: no router sent them)."""
    b = [Request(f"b{i}", "B", unique_tokens(2000), 400, 0.0) for i in range(40)]
    a = Request("a", "A", unique_tokens(1500), 16, 3.0)
    if cluster is not None:
        a.cluster_inflight = cluster[0]
        for i, r in enumerate(b):
            r.cluster_inflight = cluster[1] + i  # the latest request carries the count used
    sched = scheduler("vtc", guard=True)
    sched.policy.counters["A"] = 1e9  # what A received from this worker before
    drive(sched, SimEngine(COST), [*b, a])
    assert_finished_exactly([*b, a])
    return a, sched


def test_the_clusters_counts_decide_who_is_owed_room() -> None:
    """A worker's counters see its own share of a client only: A, served more here but with
    one call in flight over the cluster against B's 24+, takes room from B's flood; with
    the counts the other way round, or without counts (the counter decides), it does not."""
    a, sched = _served_more_here((1, 24))
    assert sched.stats.num_share_retractions >= 1 and ttft(a) < 0.2, a
    for cluster in ((64, 24), None):
        a, sched = _served_more_here(cluster)
        assert sched.stats.num_share_retractions == 0 and ttft(a) > 1.0, (cluster, a)


def test_owed_room_reads_the_latest_count_per_weight() -> None:
    from sgl_fair.worker.share_guard import latest_inflight, owed_room

    old, new = Request("o", "B", (1,), 1, 0.0), Request("n", "B", (1,), 1, 1.0)
    old.cluster_inflight, new.cluster_inflight = 30, 3
    assert latest_inflight([new, old]) == 3  # the router's latest count, not the largest
    assert latest_inflight([Request("x", "B", (1,), 1, 0.0)]) is None
    one = {"A": 1.0, "B": 1.0}.__getitem__
    assert owed_room("A", 2, "B", 3, None, one)
    assert not owed_room("A", 3, "B", 3, None, one)  # level: the order stands (no ping-pong)
    assert not owed_room("A", 2, "B", 3, None, {"A": 1.0, "B": 4.0}.__getitem__)  # per weight
    served = {"A": 5.0, "B": 1.0}.__getitem__
    assert not owed_room("A", None, "B", 3, served, one)  # a count missing: the policy's measure
    assert owed_room("A", None, "B", None, None, one)  # neither: the shares alone decide
