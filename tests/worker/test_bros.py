"""BROS (SPEC §5) and the batch-selection seam (seam #1b).

Hand-built cases drive ``BROS.select_batch`` with a linear cost model and a fake view, so
every packing rule is checked on numbers one can verify by hand; the rest runs the real
scheduler (``drive`` checks KV conservation and invariants at every state).
"""

from __future__ import annotations

import random

import pytest
from conftest import FixedEngine, assert_finished_exactly, drive, make_scheduler, unique_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.policies import make_policy, policy_names
from sgl_fair.policies.bros_batch import _Batch, _Frontier
from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.kv.token import TokenAllocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine

RT, BE = ServiceClass.RT, ServiceClass.BE


def linear_cost(*, prefill_chunks=(), decode_context_lens=()) -> float:
    """10 ms per iteration + 1 ms per prefill token + 1 ms per decode (easy to add by hand)."""
    if not prefill_chunks and not decode_context_lens:
        return 0.0
    return 0.010 + 0.001 * sum(n for n, _ in prefill_chunks) + 0.001 * len(decode_context_lens)


class FakeView:
    def __init__(self, now: float, max_running: int = 256) -> None:
        self.now = now
        self.running: list[Request] = []
        self.config = SchedulerConfig(max_running_requests=max_running)
        self.slots: dict[str, int] = {}

    def prefix_len(self, req: Request) -> int:
        return 0

    def checkpointed_slots(self, req: Request) -> int:
        return self.slots.get(req.rid, 0)


def req(rid, cls, *, arrival=0.0, input_len=10, out=5, decoded=0, client="c", ttft=0.4):
    r = Request(rid, client, tuple(range(1, input_len + 1)), out, arrival, service_class=cls)
    r.ttft_slo_s = ttft
    if decoded:
        r.phase = Phase.RUNNING
        r.output_ids = [7] * decoded
    return r


def test_most_urgent_rt_is_always_scheduled_first():
    bros = make_policy("bros")
    view = FakeView(now=1.0)
    relaxed = [req(f"r{i}", RT, arrival=0.95) for i in range(5)]
    urgent = req("urgent", RT, arrival=0.62)  # 0.02 s of its 0.4 s TTFT left
    bes = [req(f"b{i}", BE, input_len=5) for i in range(3)]
    chosen = bros.select_batch([*relaxed, *bes, urgent], view, linear_cost)
    assert chosen[0] is urgent
    # Even an RT that already missed its deadline (and would blow any residual) runs first.
    late = req("late", RT, arrival=0.0, input_len=500)
    chosen = make_policy("bros").select_batch([*relaxed, late], view, linear_cost)
    assert chosen[0] is late


def test_be_never_pushes_rt_past_its_deadline():
    view = FakeView(now=1.0)
    rt = req("rt", RT, arrival=0.0, decoded=3)  # TPOT deadline: t_last = arrival -> 0.2-1.0
    bros = make_policy("bros")
    bros._t_last[id(rt)] = 0.95  # its last token came 50 ms ago: 150 ms left
    big_be = req("big", BE, input_len=200)  # 0.010 + 0.001 + 0.200 > 0.150
    small_be = req("small", BE, input_len=100)  # 0.010 + 0.001 + 0.100 <= 0.150
    chosen = bros.select_batch([big_be, small_be, rt], view, linear_cost)
    assert chosen[0] is rt
    assert big_be not in chosen and small_be in chosen
    assert linear_cost(
        prefill_chunks=[(100, 0)], decode_context_lens=[rt.seq_len]
    ) <= bros.remaining_s(rt, 1.0)


def test_the_schedulers_chunked_continuation_is_priced_before_any_pick():
    """The scheduler runs the rest of a chunked prompt before anything a policy picks
    (``view.continued_chunk()``): BROS counts it in T_iter, so it never promises an RT a
    residual that chunk already took. It is work, not a pick."""
    rt = req("rt", RT, arrival=0.0, decoded=3)  # TPOT deadline: 150 ms left (below)
    be = req("be", BE, input_len=60)  # alone with rt: 0.010 + 0.001 + 0.060 = 71 ms: fits

    def chosen_with(chunk):
        view = FakeView(now=1.0)
        view.continued_chunk = lambda: chunk
        bros = make_policy("bros")
        bros._t_last[id(rt)] = 0.95
        return bros.select_batch([rt, be], view, linear_cost), bros

    picked, _ = chosen_with(None)
    assert picked == [rt, be]
    picked, bros = chosen_with((100, 400, True))  # 100 more ms of prefill: rt fits beside it
    assert picked == [rt]
    assert bros.t_bar_s > make_policy("bros").t_bar_s  # its estimate includes the chunk
    picked, _ = chosen_with((500, 0, True))  # over the residual alone: rt (most urgent) runs
    assert picked == [rt]


def test_no_waiting_pick_while_a_chunked_prompt_goes_on():
    """Unless the continued chunk ends its prompt, the scheduler admits no waiting request in
    that step: BROS picks none (pricing one would only shrink the batch that does run)."""
    waiting_rt = req("new", RT, arrival=0.7, input_len=20)  # urgent: 0.1 s of its TTFT left
    decoding = req("dec", RT, arrival=0.0, decoded=3)
    for last, want in ((False, [decoding]), (True, [waiting_rt, decoding])):
        view = FakeView(now=1.0)
        view.continued_chunk = lambda last=last: (10, 100, last)
        bros = make_policy("bros")
        bros._t_last[id(decoding)] = 0.95
        assert bros.select_batch([waiting_rt, decoding], view, linear_cost) == want


def test_early_return_resets_b_and_skips_be():
    bros = make_policy("bros", b0=8)
    bros.batch_limit = 20
    view = FakeView(now=1.0)
    urgent = req("u", RT, arrival=0.625)  # 25 ms left: room for one 20 ms prefill only
    other = req("o", RT, arrival=0.99)
    be = req("b", BE, input_len=1)
    chosen = bros.select_batch([urgent, other, be], view, linear_cost)
    assert chosen == [urgent]  # early return: the batch as it was, no BE phase
    assert bros.batch_limit == bros.config.b0 == 8
    assert bros.num_early_returns == 1


def test_default_b0_is_the_engine_max():
    """b0=None (the default): B starts and resets at max_running_requests, never below."""
    bros = make_policy("bros")
    view = FakeView(now=1.0, max_running=12)
    urgent = req("u", RT, arrival=0.625)
    other = req("o", RT, arrival=0.99)
    bros.select_batch([urgent, other], view, linear_cost)  # early return
    assert bros.num_early_returns == 1 and bros.batch_limit == 12
    rts = [req(f"r{i}", RT, arrival=0.99) for i in range(20)]
    assert len(bros.select_batch(rts, view, linear_cost)) <= 12


def test_b_grows_by_one_without_early_return_up_to_the_engine_max():
    bros = make_policy("bros", b0=8)
    view = FakeView(now=1.0, max_running=10)
    rts = [req(f"r{i}", RT, arrival=0.99) for i in range(3)]
    for expect in (9, 10, 10):
        bros.select_batch(rts, view, linear_cost)
        assert bros.batch_limit == expect


def test_full_batch_swaps_least_urgent_rt_with_slack_for_be():
    bros = make_policy("bros", b0=2, b_step=0)
    view = FakeView(now=1.0)
    urgent = req("u", RT, arrival=0.0, decoded=2)
    slack = req("s", RT, arrival=0.0, decoded=2)
    bros._t_last[id(urgent)] = 0.9  # 100 ms left
    bros._t_last[id(slack)] = 1.0  # 200 ms left: can skip one iteration
    be = req("b", BE, decoded=1)
    chosen = bros.select_batch([urgent, slack, be], view, linear_cost)
    assert chosen == [urgent, be]


def test_be_order_fewest_checkpointed_slots_then_inner_fairness():
    view = FakeView(now=1.0)
    a, b = req("a", BE, client="x"), req("b", BE, client="y")
    view.slots = {"a": 16, "b": 0}
    assert make_policy("bros").select_batch([a, b], view, linear_cost) == [b, a]
    bros = make_policy("bros", inner="vtc")
    for r in (a, b):
        bros.on_arrival(r, 0.0)
    bros.inner.counters.update({"x": 0.0, "y": 500.0})  # x is the least served
    assert bros.select_batch([a, b], view, linear_cost) == [a, b]


@pytest.mark.parametrize("name", ["fcfs", "lpm", "vtc", "dlpm", "lcf", "rpm"])
def test_seam_leaves_order_policies_unchanged(name):
    """Same workload with and without a cost model in the scheduler: identical runs."""
    assert not hasattr(make_policy(name), "select_batch")
    runs = []
    for cost in (None, CostModel.from_names("A10G", "Llama-2-7B").step_time):
        rng = random.Random(3)
        reqs = [
            Request(
                f"r{i}",
                "ab"[i % 2],
                unique_tokens(rng.randint(5, 60)),
                rng.randint(1, 30),
                i * 0.01,
            )
            for i in range(40)
        ]
        kv = PrefixKVCache(TokenAllocator(600))
        sched = Scheduler(policy=make_policy(name), kv=kv, cost=cost)
        drive(sched, FixedEngine(), reqs)
        runs.append([(r.rid, r.first_token_s, r.finish_s) for r in reqs])
    assert runs[0] == runs[1]


def hybrid_workload(seed: int, *, num_rt: int = 30, num_be: int = 12) -> list[Request]:
    rng = random.Random(seed)
    out = [
        Request(
            f"rt{i}",
            "chat",
            unique_tokens(rng.randint(5, 80)),
            rng.randint(1, 30),
            i * 0.03,
            service_class=RT,
        )
        for i in range(num_rt)
    ]
    out += [
        Request(
            f"be{i}",
            f"batch{i % 2}",
            unique_tokens(rng.randint(50, 120)),
            rng.randint(5, 40),
            0.0,
            service_class=BE,
        )
        for i in range(num_be)
    ]
    return out


@pytest.mark.parametrize(
    "name,opts", [("bros", {}), ("bros", {"inner": "vtc"}), ("bros", {"inner": "dlpm"}), ("rr", {})]
)
def test_selecting_policies_finish_everything_with_invariants(name, opts):
    """Mixed batches, paused requests and retraction under a small pool keep every invariant."""
    reqs = hybrid_workload(1)
    kv = PrefixKVCache(TokenAllocator(900))
    sched = Scheduler(
        policy=make_policy(name, **opts),
        kv=kv,
        cost=CostModel.from_names("A10G", "Llama-2-7B").step_time,
        config=SchedulerConfig(chunked_prefill_size=256),
    )
    drive(sched, SimEngine(CostModel.from_names("A10G", "Llama-2-7B")), reqs)
    assert_finished_exactly(reqs)


def test_rt_ttft_protected_while_be_runs():
    """With a BE backlog, BROS serves RT first: better RT TTFT attainment than FCFS."""
    cm = CostModel.from_names("A10G", "Llama-2-7B")
    attain = {}
    for name in ("fcfs", "bros"):
        reqs = hybrid_workload(2, num_rt=40, num_be=60)
        sched = make_scheduler(name, capacity=6000)
        sched.cost = cm.step_time
        drive(sched, SimEngine(cm), reqs)
        rt = [r for r in reqs if r.service_class is RT]
        attain[name] = sum(r.first_token_s - r.arrival_s <= r.ttft_slo_s for r in rt) / len(rt)
    assert attain["bros"] >= attain["fcfs"]
    assert attain["bros"] >= 0.9


def test_registered():
    assert {"bros", "rr"} <= set(policy_names())
    with pytest.raises(ValueError, match="inner"):
        make_policy("bros", inner="lpm")


@pytest.mark.parametrize("allocator", ["paged", "bidirectional"])
def test_bros_over_block_allocators_keeps_invariants(allocator):
    """RT grows into BE blocks (checkpoints, restores) under a small pool; all finish."""
    cm = CostModel.from_names("A10G", "Llama-2-7B")
    reqs = hybrid_workload(4, num_rt=25, num_be=10)
    kv = PrefixKVCache(make_allocator(allocator, 1200, block_size=8))
    sched = Scheduler(policy=make_policy("bros"), kv=kv, cost=cm.step_time)
    drive(sched, SimEngine(cm), reqs, token_pool=False)
    assert_finished_exactly(reqs)
    if allocator == "bidirectional":
        assert kv.allocator.host_used_tokens() == 0
        assert not kv.allocator._class  # every finished request was forgotten


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    rts=st.lists(
        st.tuples(st.floats(0.0, 0.6), st.integers(1, 120), st.integers(0, 3)), max_size=12
    ),
    bes=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 2)), max_size=12),
    limit=st.integers(1, 10),
)
def test_no_batch_pushes_a_chosen_rt_past_its_deadline(rts, bes, limit):
    """Property: T_iter(batch) <= every chosen RT's remaining time, except the single most
    urgent RT that no batch could save (always scheduled; then nothing else joins)."""
    view = FakeView(now=1.0)
    bros = make_policy("bros", b0=limit, b_step=0)
    cands = [
        req(f"r{i}", RT, arrival=1.0 - age, input_len=n, decoded=d, out=10)
        for i, (age, n, d) in enumerate(rts)
    ]
    cands += [req(f"b{i}", BE, input_len=n, decoded=d, out=10) for i, (n, d) in enumerate(bes)]
    rem = {id(r): bros.remaining_s(r, 1.0) for r in cands if r.service_class is RT}
    chosen = bros.select_batch(cands, view, linear_cost)
    assert len(chosen) <= max(limit, 1) and len(set(map(id, chosen))) == len(chosen)
    batch = _Batch(linear_cost, view)
    for r in chosen:
        batch.add(r)
    t_iter = batch.time()
    floor_s = linear_cost(decode_context_lens=(1,))
    saveable = [r for r in chosen if r.service_class is RT and rem[id(r)] >= floor_s]
    late = [r for r in saveable if rem[id(r)] < t_iter]
    if late:  # only the most urgent saveable RT, alone among saveable ones, and no BE
        assert late == saveable[:1] == saveable
        assert all(r.service_class is RT for r in chosen)
    if any(r.service_class is RT for r in cands):
        most_urgent = min((r for r in cands if r.service_class is RT), key=lambda r: rem[id(r)])
        # Scheduled, unless it had slack beyond this iteration and a BE took its place.
        assert most_urgent in chosen or rem[id(most_urgent)] >= t_iter


def test_aborting_a_checkpointed_be_request_drops_its_host_copy():
    """A paused BE request whose KV is partly on the host can be aborted (client gone): its
    device and host tokens are freed, nothing goes to the cache, the rest still finishes."""
    cm = CostModel.from_names("A10G", "Llama-2-7B")
    reqs = hybrid_workload(4, num_rt=25, num_be=10)
    kv = PrefixKVCache(make_allocator("bidirectional", 1200, block_size=8))
    sched = Scheduler(policy=make_policy("bros"), kv=kv, cost=cm.step_time)
    aborted = []

    def abort_checkpointed(s: Scheduler, now: float) -> None:
        for r in list(s.running):
            if s.checkpointed_slots(r) > 0:
                assert s.abort(r, now)
                aborted.append(r)
                s.check_invariants()

    drive(sched, SimEngine(cm), reqs, before_step=abort_checkpointed, token_pool=False)
    assert aborted, "the workload must checkpoint some BE request"
    assert all(r.phase is Phase.ABORTED for r in aborted)
    assert_finished_exactly([r for r in reqs if r not in aborted])
    assert kv.allocator.host_used_tokens() == 0
    assert not kv.allocator._class


def test_t_iter_counts_the_swap_in_of_checkpointed_be_requests():
    """T_iter = max(compute, swap-in) when the cost prices swap-in (the simulator's does): a
    BE request whose checkpointed KV takes longer to copy back than the RT deadline allows
    stays out; the same request with nothing on the host joins."""
    cm = CostModel.from_names("A100-80GB", "Llama-2-7B")
    view = FakeView(now=1.0)
    rt = req("r", RT, arrival=0.0, decoded=3)
    be = req("b", BE, decoded=2)
    bros = make_policy("bros")
    bros._t_last[id(rt)] = 0.95  # 150 ms to the next token's deadline
    assert bros.select_batch([rt, be], view, cm.step_time) == [rt, be]
    # Llama-2-7B's KV is 512 KiB a token, copied at 25 GB/s: 20,000 tokens ≈ 0.4 s > 150 ms.
    view.slots = {"b": 20_000}
    swap_s = cm.step_time(decode_context_lens=[be.seq_len], swap_in_tokens=20_000)
    assert swap_s > 0.15 > cm.step_time(decode_context_lens=[be.seq_len])
    bros2 = make_policy("bros")
    bros2._t_last[id(rt)] = 0.95
    assert bros2.select_batch([rt, be], view, cm.step_time) == [rt]
    # A cost callable that does not price swap-in is called as before.
    assert bros2.select_batch([rt, be], view, linear_cost) == [rt, be]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    first=st.lists(st.tuples(st.integers(1, 900), st.integers(0, 3)), max_size=4),
    rest=st.lists(
        st.tuples(st.integers(1, 900), st.integers(0, 3), st.integers(0, 40)), max_size=40
    ),
    cap_ms=st.floats(0.0, 400.0),
)
def test_add_prefix_adds_what_one_by_one_packing_adds(first, rest, cap_ms):
    """``_Batch.add_prefix`` (binary search) adds exactly the requests that adding one at a time
    while ``T_iter <= cap`` adds (Alg. 1 l.6–15), under the simulator's non-linear cost with
    swap-in priced: the seam BROS's RT phase relies on."""
    cost = CostModel.from_names("A100-80GB", "Llama-3-70B", 8).step_time
    view = FakeView(now=1.0)
    batches = (_Batch(cost, view, swap_ok=True), _Batch(cost, view, swap_ok=True))
    for i, (n, d) in enumerate(first):
        for b in batches:
            b.add(req(f"f{i}", RT, input_len=n, decoded=d))
    reqs = []
    for i, (n, d, slots) in enumerate(rest):
        r = req(f"r{i}", RT, input_len=n, decoded=d)
        view.slots[r.rid] = slots * 16 if d else 0
        reqs.append(r)
    one_by_one, searched = batches
    cap = cap_ms / 1e3
    added = 0
    for r in reqs:
        if one_by_one.time_with(r) > cap:
            break
        one_by_one.add(r)
        added += 1
    assert searched.add_prefix(reqs, cap) == added
    assert [r.rid for r in searched.requests()] == [r.rid for r in one_by_one.requests()]
    assert searched.time() == one_by_one.time()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    # RT requests 0.25-0.39 s into their 0.4 s TTFT: residuals a BE prefill can overrun.
    rts=st.lists(
        st.tuples(st.floats(0.25, 0.39), st.integers(1, 300), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    ),
    # BE: waiting (decoded 0) or decoding with few or many checkpointed blocks, 3 clients.
    bes=st.lists(
        st.tuples(
            st.integers(1, 3000),
            st.sampled_from([0, 0, 1, 3]),
            st.one_of(st.integers(0, 40), st.integers(0, 3000)),
            st.integers(0, 2),
        ),
        max_size=40,
    ),
    limit=st.integers(1, 60),
)
def test_be_phase_skips_only_work_that_cannot_fit(rts, bes, limit):
    """The BE phase skips, unpriced, BE work at least as large as work already priced over
    the residual. Under the simulator's cost (swap-in priced), it chooses exactly what
    pricing every BE request chooses."""
    cost = CostModel.from_names("A100-80GB", "Llama-3-70B", 8).step_time
    view = FakeView(now=1.0)
    cands = [
        req(f"r{i}", RT, arrival=1.0 - age, input_len=n, decoded=d, out=10)
        for i, (age, n, d) in enumerate(rts)
    ]
    for i, (n, d, slots, client) in enumerate(bes):
        b = req(f"b{i}", BE, input_len=n, decoded=d, out=10, client=f"c{client}")
        view.slots[b.rid] = slots * 16 if d else 0
        cands.append(b)

    def policy():  # BE clients served unequally: BE is not sorted by work within the phase
        p = make_policy("bros", b0=limit, b_step=0, inner="vtc")
        p.inner.counters.update({f"c{c}": 100.0 * c for c in range(3)})
        return p

    skipping = policy().select_batch(list(cands), view, cost)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_Frontier, "dominates", lambda self, key: False)
        pricing = policy().select_batch(list(cands), view, cost)
    assert [r.rid for r in skipping] == [r.rid for r in pricing]


def test_be_smaller_than_one_that_overran_is_still_added():
    """150 ms residual, linear cost: BE of 200 prompt tokens overruns it, BE of 100 fits and
    joins, BE of 250 is skipped unpriced (it is at least as large as the one that overran)."""
    view = FakeView(now=1.0)
    rt = req("rt", RT, arrival=0.75)  # 150 ms to its TTFT deadline
    big, small, bigger = (req(f"be{n}", BE, input_len=n) for n in (200, 100, 250))
    bros = make_policy("bros")
    priced = []
    time_with = _Batch.time_with

    def spy(self, r, *args, **kwargs):
        priced.append(r.rid)
        return time_with(self, r, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_Batch, "time_with", spy)
        chosen = bros.select_batch([rt, big, small, bigger], view, linear_cost)
    assert [r.rid for r in chosen] == ["rt", "be100"]
    assert "be250" not in priced and {"be200", "be100"} <= set(priced)


def test_frontier_keeps_the_minimal_overruns():
    f = _Frontier()
    f.add((0, 500, 0, 0))
    assert f.dominates((0, 500, 0, 0)) and f.dominates((0, 600, 10, 5))
    assert not f.dominates((0, 499, 0, 0)) and not f.dominates((1, 900, 0, 0))
    f.add((0, 300, 0, 0))  # smaller: replaces the 500 point
    assert f._keys == [(0, 300, 0, 0)]
    f.add((1, 64, 0, 16))
    assert f.dominates((1, 64, 0, 16)) and not f.dominates((1, 64, 0, 0))


def test_order_for_hosts_without_batch_selection_puts_urgent_rt_first_then_fair_be():
    """``BROS.order`` (what the SGLang plugin runs): RT by remaining time to the deadline, the
    most urgent first, whatever the arrival order; then BE in the inner policy's order (VTC:
    the least-served client first, re-read after each admission)."""
    bros = make_policy("bros", inner="vtc")
    heavy = [req(f"h{i}", BE, arrival=0.0, client="heavy", input_len=50) for i in range(2)]
    light = req("light", BE, arrival=0.2, client="light", input_len=50)
    late_rt = req("rt-late", RT, arrival=0.5)
    old_rt = req("rt-old", RT, arrival=0.3)
    waiting = [*heavy, old_rt, light, late_rt]
    for r in waiting:
        bros.on_arrival(r, r.arrival_s)
    before = req("h-before", BE, client="heavy", input_len=400)
    bros.on_arrival(before, 0.0)
    bros.on_admitted(before, 400)  # heavy was served already
    view = FakeView(now=0.6)
    out = []
    for r in bros.order(waiting, view):
        out.append(r.rid)
        bros.on_admitted(r, r.input_len)
    assert out[:2] == ["rt-old", "rt-late"]  # 0.1 s left vs 0.3 s: the older is more urgent
    assert out[2] == "light"  # heavy was served 400 tokens already
    assert sorted(out[3:]) == ["h0", "h1"]
    no_inner = make_policy("bros")
    assert [r.rid for r in no_inner.order(waiting, view)] == [
        "rt-old", "rt-late", "h0", "h1", "light"
    ]  # fmt: skip


@pytest.mark.parametrize("policy", ["bros", "fcfs"])
def test_continued_chunk_is_the_chunk_the_step_runs_first(policy):
    """``Scheduler.continued_chunk()`` before a step names the first prefill chunk of that
    step while a prompt is chunked over steps (both paths: batch selection and the walk)."""
    sched = make_scheduler(policy, capacity=20_000, chunked_prefill_size=64)
    long = Request("long", "c", unique_tokens(300), 4, 0.0, service_class=BE)
    short = Request("short", "c", unique_tokens(20), 4, 0.0, service_class=RT)
    seen = []

    def check(s, now):
        seen.append(s.continued_chunk())

    def after(s, batch, now):
        want = seen[-1]
        if want is not None:
            first = batch.prefill[0]
            assert (first.num_tokens, first.start, first.last) == want and first.req is long
            if not first.last:  # the prompt goes on: nothing else is admitted in this step
                assert [c.req for c in batch.prefill] == [long]

    drive(sched, FixedEngine(), [long, short], before_step=check, after_step=after)
    continued = [c for c in seen if c is not None]
    assert len(continued) >= 3 and all(n == 64 for n, _, _ in continued[:-1])  # the case ran
    assert continued[-1][2] and sum(continued[-1][:2]) == 300  # the last ends the prompt
