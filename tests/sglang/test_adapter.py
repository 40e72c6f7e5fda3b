"""The plugin inside SGLang's real admission code: same order as the pure policy, same counters.

Every admission here runs SGLang 0.5.23's own ``Scheduler._get_new_batch_prefill_raw`` (see
``sglang_rig.py``) with its real ``Req``, ``RadixCache`` and ``PrefillAdder``, the plugin's hooks
applied through SGLang's ``HookRegistry``. The reference is the pure policy's own walk
(``reference_order``): the calls our scheduler makes when every request fits.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
from sglang_rig import Rig, make_req

from sgl_fair.policies import make_policy
from sgl_fair.radix import RadixTree
from sgl_fair.request import Request
from sgl_fair.worker.sglang import plugin
from sgl_fair.worker.sglang.settings import PluginSettings

POLICIES = {
    "dlpm": {"quantum": 300},
    "vtc": {},
    "lcf": {},
    "lpm": {},
    "fcfs": {},
}


@pytest.fixture(scope="module", autouse=True)
def hooks(monkeypatch_module):
    """Register and apply the plugin's hooks, as SGLang's load_plugins() does."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for k, v in PluginSettings("vtc", {}).env().items():
        monkeypatch_module.setenv(k, v)
    plugin._settings = None
    plugin.register()
    HookRegistry.apply_hooks()
    yield


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def fair_rig(policy: str, opts: dict, **rig_kwargs) -> Rig:
    rig = Rig(**rig_kwargs)
    plugin.install_policy(rig.scheduler, PluginSettings(policy, opts))
    return rig


class RefView:
    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.now = 0.0
        self.running = ()

    def prefix_len(self, req: Request) -> int:
        return self.tree.match(req.input_ids).length


def reference_order(policy, waiting: list[Request], tree: RadixTree, limit: int | None = None):
    """The pure policy's admission walk: pull, charge the extend tokens, pull the next."""
    view = RefView(tree)
    out: list[Request] = []
    walk = policy.order(waiting, view)
    for req in walk:
        if limit is not None and len(out) == limit:
            break
        cached = min(view.prefix_len(req), req.input_len - 1)
        out.append(req)
        policy.on_admitted(req, req.input_len - cached)
    getattr(walk, "close", lambda: None)()
    return out


def workload(n: int, seed: int, clients=("a", "b", "c", "flood")):
    """Prompts from shared documents (so prefixes matter) by clients of unequal volume."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 30000) for _ in range(rng.randint(20, 200))] for _ in range(6)]
    out = []
    for _ in range(n):
        client = rng.choice(clients + ("flood",) * 3)
        doc = rng.choice(docs)
        tail = [rng.randrange(30000, 32000) for _ in range(rng.randint(5, 60))]
        out.append((client, doc[: rng.randint(10, len(doc))] + tail))
    return docs, out


def setup_pair(policy: str, opts: dict, n: int, seed: int, **rig_kwargs):
    """The same state on both sides: cached documents, queued requests, per-client history."""
    docs, reqs = workload(n, seed)
    rig = fair_rig(policy, opts, **rig_kwargs)
    fair = rig.scheduler.policy
    pure = make_policy(policy, **opts)
    tree = RadixTree()
    for doc in docs[:4]:
        rig.cache(doc)
        tree.insert(tuple(doc))
    # History: 'flood' was served a lot already (admitted and decoded), 'a' a little.
    for client, k in (("flood", 3), ("a", 1)):
        for j in range(k):
            ids = [7 + j] * 400
            s = make_req(ids, client)
            fair.ledger.arrived(s)
            m = Request(s.rid, client, tuple(ids), 16, 0.0)
            pure.on_arrival(m, 0.0)
            fair.ledger.admitted(s, 400)
            pure.on_admitted(m, 400)
            s.output_ids.extend([5] * 16)
            s.finished_reason = FINISH_LENGTH(16)
            fair.after_batch(SimpleNamespace(reqs=[s]))
            m.output_ids.extend([5] * 16)
            pure.on_tokens(m, 16)
            pure.on_finished(m)
    mirrors = []
    for i, (client, ids) in enumerate(reqs):
        s = make_req(ids, client, rid=f"w{i}")
        rig.queue(s)
        m = Request(s.rid, client, tuple(ids), 16, float(i))
        pure.on_arrival(m, float(i))
        mirrors.append(m)
    return rig, pure, tree, mirrors


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("n", [40, 300])
def test_admission_order_matches_the_pure_policy(policy, n):
    """All fit: SGLang admits every waiting request, in exactly the pure policy's order —
    also above 128 waiting, where SGLang's own LPM would fall back to FCFS."""
    big = 1 << 21
    rig, pure, tree, mirrors = setup_pair(
        policy, POLICIES[policy], n, seed=n, kv_tokens=big, max_prefill_tokens=big,
        chunked_prefill_size=big,
    )  # fmt: skip
    admitted = rig.admit()
    expected = reference_order(pure, mirrors, tree)
    assert [r.rid for r in admitted] == [m.rid for m in expected]
    assert not rig.scheduler.waiting_queue
    fair = rig.scheduler.policy
    assert fair.num_resyncs == 0
    # Same counters after the walk's charges.
    state = getattr(pure, "counters", None) or getattr(pure, "deficits", None)
    if state is not None:
        got = getattr(fair.fair, "counters", None) or getattr(fair.fair, "deficits", None)
        assert got == pytest.approx(state)


@pytest.mark.parametrize("policy", ["dlpm", "vtc"])
def test_a_budget_admits_a_prefix_of_the_pure_order(policy):
    """With a prefill budget SGLang stops early: what it admits is the head of our order
    (the last one may be chunked), and the rest stays queued for the next walk."""
    rig, pure, tree, mirrors = setup_pair(
        policy, POLICIES[policy], 200, seed=7, max_prefill_tokens=3000, chunked_prefill_size=3000
    )
    admitted = rig.admit()
    assert 1 <= len(admitted) < 200
    expected = reference_order(pure, mirrors, tree, limit=len(admitted))
    assert [r.rid for r in admitted] == [m.rid for m in expected]
    assert len(rig.scheduler.waiting_queue) == 200 - len(admitted)


def test_sglang_lpm_degrades_to_fcfs_above_128_and_ours_does_not():
    """The difference is real: with 200 waiting, SGLang's own LPM admits in arrival order,
    the plugin's LPM puts the longest cached prefixes first."""
    big = 1 << 21
    kw = dict(kv_tokens=big, max_prefill_tokens=big, chunked_prefill_size=big)
    docs, reqs = workload(200, seed=3)
    plain = Rig(policy="lpm", **kw)
    ours = fair_rig("lpm", {}, **kw)
    for rig in (plain, ours):
        for doc in docs[:4]:
            rig.cache(doc)
        for i, (client, ids) in enumerate(reqs):
            rig.queue(make_req(ids, client, rid=f"q{i}"))
    arrival = [f"q{i}" for i in range(200)]
    assert [r.rid for r in plain.admit()] == arrival
    got = ours.admit()
    lens = [r.prefix_len for r in got]
    assert [r.rid for r in got] != arrival
    assert lens == sorted(lens, reverse=True)


def test_client_id_comes_from_routing_key_not_extra_key():
    rig = fair_rig("vtc", {})
    fair = rig.scheduler.policy
    s = make_req([1, 2, 3], "alice")
    s.extra_key = "tenant-cache-partition"
    fair.ledger.arrived(s)
    assert fair.ledger.mirror(s).client == "alice"
    anon = make_req([1, 2, 3], None)
    fair.ledger.arrived(anon)
    assert fair.ledger.mirror(anon).client == "default"


# ---- accounting -------------------------------------------------------------------------------


class PureSide:
    """The calls our simulator's scheduler makes on its policy, event by event."""

    def __init__(self, policy: str, opts: dict) -> None:
        self.policy = make_policy(policy, **opts)
        self.reqs: dict[str, Request] = {}
        self.tree = RadixTree()  # what the worker has cached

    def arrive(self, rid, ids, client, t):
        m = Request(rid, client, tuple(ids), 64, t)
        self.reqs[rid] = m
        self.policy.on_arrival(m, t)

    def walk(self, rids, extend_of) -> list[str]:
        """One admission walk over ``rids`` (all fit), as the scheduler runs it."""
        out = []
        walk = self.policy.order([self.reqs[r] for r in rids], RefView(self.tree))
        for m in walk:
            out.append(m.rid)
            self.policy.on_admitted(m, extend_of[m.rid] if m.num_retractions == 0 else 0)
        return out

    def tokens(self, rid, n):
        m = self.reqs[rid]
        for _ in range(n):  # the simulator emits one token at a time
            m.output_ids.append(1)
            self.policy.on_tokens(m, 1)

    def finish(self, rid):
        self.policy.on_finished(self.reqs.pop(rid))

    def abort(self, rid, waiting):
        self.policy.on_aborted(self.reqs.pop(rid), waiting)

    def retract(self, rid):
        m = self.reqs[rid]
        m.num_retractions += 1
        self.policy.on_retracted(m)


def counters(policy) -> dict:
    for name in ("counters", "deficits"):
        if hasattr(policy, name):
            return dict(getattr(policy, name))
    raise AssertionError("policy keeps no counters")


@pytest.mark.parametrize("policy,opts", [("vtc", {}), ("dlpm", {"quantum": 50}), ("lcf", {})])
def test_accounting_hooks_charge_what_the_simulator_charges(policy, opts):
    """A scripted life: arrivals, admissions through SGLang's loop (prefix hits), decode steps
    of 1 and of several tokens (speculative decoding), a finish, an abort while queued, an
    abort while running, and a retraction with re-admission (not charged twice)."""
    rig = fair_rig(policy, opts, max_prefill_tokens=100_000)
    fair = rig.scheduler.policy
    pure = PureSide(policy, opts)
    rig.cache(list(range(30)))  # a's prompts share 30 cached tokens
    pure.tree.insert(tuple(range(30)))

    def check():
        assert counters(fair.fair) == pytest.approx(counters(pure.policy)), "counters diverged"

    sreqs = {}
    for rid, client, n in (("a1", "a", 80), ("b1", "b", 50), ("a2", "a", 60), ("b2", "b", 20)):
        first = 0 if client == "a" else 1000
        s = make_req(list(range(first, first + n)), client, max_new_tokens=64, rid=rid)
        sreqs[rid] = s
        pure.arrive(rid, s.origin_input_ids, client, 0.0)
    for rid in ("a1", "b1", "a2"):
        rig.queue(sreqs[rid])
    admitted = rig.admit()
    extend = {r.rid: len(r.full_untruncated_fill_ids) - r.prefix_len for r in admitted}
    assert [r.rid for r in admitted] == pure.walk(["a1", "b1", "a2"], extend)
    assert sreqs["a1"].prefix_len == 30 and sreqs["b1"].prefix_len == 0
    check()
    running = list(admitted)
    rig.queue(sreqs["b2"])
    for step_tokens in (1, 1, 3, 1, 4):  # decode steps; 3 and 4: accepted draft tokens
        for r in running:
            r.output_ids.extend([9] * step_tokens)
            pure.tokens(r.rid, step_tokens)
        fair.after_batch(SimpleNamespace(reqs=running))
        check()
    # a2 finishes; b1 is aborted mid-decode (SGLang's abort finish reason, one more token)
    sreqs["a2"].finished_reason = FINISH_LENGTH(10)
    sreqs["b1"].output_ids.append(9)
    pure.tokens("b1", 1)
    sreqs["b1"].finished_reason = FINISH_ABORT("client went away")
    fair.after_batch(SimpleNamespace(reqs=running))
    pure.finish("a2")
    pure.abort("b1", waiting=False)
    check()
    running = [sreqs["a1"]]
    # b2, still queued, is aborted (Scheduler.abort_request pops it from the queue)
    rig.scheduler.waiting_queue.remove(sreqs["b2"])
    plugin._after_abort(None, rig.scheduler, SimpleNamespace(rid="b2"))
    pure.abort("b2", waiting=True)
    check()
    # a1 is retracted under memory pressure, then re-admitted: no second input charge
    fair.after_retract([sreqs["a1"]], [])
    pure.retract("a1")
    rig.queue(sreqs["a1"])
    assert [r.rid for r in rig.admit()] == ["a1"] == pure.walk(["a1"], {"a1": 0})
    check()
    sreqs["a1"].output_ids.extend([9, 9])
    pure.tokens("a1", 2)
    sreqs["a1"].finished_reason = FINISH_LENGTH(14)
    fair.after_batch(SimpleNamespace(reqs=[sreqs["a1"]]))
    pure.finish("a1")
    check()
    assert len(fair.ledger) == 0  # every request settled exactly once


def test_policy_refusal_aborts_the_request_with_429():
    """An ``rpm`` limit refuses at arrival: the request never enters SGLang's queue and the
    client gets an abort with status 429 and the reason."""
    rig = fair_rig("rpm", {"limit": 1})
    s = rig.scheduler
    sent = []
    s._release_aborted_request = lambda req: None
    s.send_abort_output = lambda abort_req, req: sent.append(abort_req)
    s.disaggregation_mode = SimpleNamespace(value="null")
    first, second = make_req([1, 2, 3], "c"), make_req([1, 2, 4], "c")
    plugin._around_add_request(lambda sch, req, *a, **k: sch.waiting_queue.append(req), s, first)
    plugin._around_add_request(lambda sch, req, *a, **k: sch.waiting_queue.append(req), s, second)
    assert s.waiting_queue == [first]
    assert len(sent) == 1 and sent[0].rid == second.rid
    assert sent[0].finished_reason["status_code"] == 429
    assert "rejected by the fair scheduler" in sent[0].finished_reason["message"]


def test_plugin_is_off_without_the_environment(monkeypatch):
    """Installing sgl-fair changes nothing until the launcher switches the plugin on."""
    from sgl_fair.worker.sglang.settings import ENV_POLICY, settings_from_env

    monkeypatch.delenv(ENV_POLICY, raising=False)
    assert settings_from_env() is None
    monkeypatch.setenv(ENV_POLICY, "no-such-policy")
    with pytest.raises(SystemExit, match="SGLFAIR_SCHEDULE_POLICY"):
        plugin.register()


def test_the_entry_point_is_installed():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "sgl_fair"]
    assert ep.load() is plugin.register


def test_bros_inside_sglang_admits_urgent_rt_first_then_be_fairly():
    """``--schedule-policy bros`` in SGLang's own admission: a request's class comes from
    SGLang's ``priority`` (our bridge sends ``RT_PRIORITY`` for RT); RT requests are admitted
    first, the closest to its TTFT deadline first, then BE in the inner VTC order (the light
    client before the heavy one's second request), not in arrival order."""
    from sgl_fair.request import ServiceClass
    from sgl_fair.worker.sglang.settings import RT_PRIORITY

    rig = fair_rig("bros", {"inner": "vtc"})
    fair = rig.scheduler.policy
    clock = [0.0]
    fair.ledger.clock = lambda: clock[0]
    arrivals = [
        ("h0", "heavy", None, 0.00),
        ("h1", "heavy", None, 0.00),
        ("light", "light", None, 0.10),
        ("rt-new", "chat", RT_PRIORITY, 0.20),
        ("rt-old", "chat", RT_PRIORITY, 0.15),
        ("low", "chat", RT_PRIORITY - 1, 0.16),  # below the RT threshold: BE
    ]
    for i, (rid, client, priority, at) in enumerate(arrivals):
        s = make_req([1000 + 10 * i + j for j in range(50)], client, rid=rid)
        s.priority = priority
        clock[0] = at
        assert fair.ledger.arrived(s) is None
        rig.queue(s)
    classes = {rid: m.service_class for rid, m in fair.ledger.mirrors.items()}
    assert [rid for rid, c in classes.items() if c is ServiceClass.RT] == ["rt-new", "rt-old"]
    clock[0] = 0.3
    admitted = [r.rid for r in rig.admit()]
    assert admitted[:2] == ["rt-old", "rt-new"]
    assert admitted[2:] == ["h0", "light", "low", "h1"]  # VTC: least served client first


def test_a_running_request_queued_again_by_sglangs_preemption_is_retracted():
    """SGLang's priority preemption (``PrefillAdder.preempt_to_schedule``) puts the running
    requests it preempts back through ``_add_request_to_queue``, not ``retract_decode``: the
    ledger counts that as a retraction, so the policy sees the client waiting again and the
    re-admission charges no prompt twice."""
    from sgl_fair.request import Phase
    from sgl_fair.worker.sglang.settings import RT_PRIORITY

    rig = fair_rig("bros", {"inner": "vtc"})
    s, fair = rig.scheduler, rig.scheduler.policy
    queue = lambda sch, req, *a, **k: sch.waiting_queue.append(req)  # noqa: E731
    be = make_req(list(range(100, 160)), "batch", rid="be")
    plugin._around_add_request(queue, s, be)
    [admitted] = rig.admit()
    assert admitted is be and fair.ledger.mirrors["be"].phase is Phase.RUNNING
    inner = fair.fair.inner
    charged = inner.counter("batch")
    s.waiting_queue.clear()
    rt = make_req(list(range(200, 230)), "chat", rid="rt")
    rt.priority = RT_PRIORITY
    plugin._around_add_request(queue, s, rt)
    plugin._around_add_request(queue, s, be)  # preempted for rt: queued again
    m = fair.ledger.mirrors["be"]
    assert m.phase is Phase.WAITING and m.num_retractions == 1
    assert [r.rid for r in rig.admit()] == ["rt", "be"]  # RT first; then be, charged once
    assert inner.counter("batch") == charged


def test_an_rt_requests_slos_come_from_custom_params():
    """The bridge sends an RT request's SLOs in ``custom_params`` (``SLO_PARAM``): the mirror
    takes them (a tighter TTFT puts a later request first); absent or malformed, the defaults."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_fair.request import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S, SLO_PARAM
    from sgl_fair.worker.sglang.mirror import mirror_of
    from sgl_fair.worker.sglang.settings import RT_PRIORITY

    def rt(rid, slo=None):
        r = make_req([7, 8, 9], "chat", rid=rid)
        r.priority = RT_PRIORITY
        if slo is not None:
            r.sampling_params = SamplingParams(max_new_tokens=16, custom_params={SLO_PARAM: slo})
        return r

    m = mirror_of(rt("a", [0.1, 0.05]), 0.0)
    assert (m.ttft_slo_s, m.tpot_slo_s) == (0.1, 0.05)
    for bad in (None, [0.1], [0, 0.1], ["x", 0.1], [True, 0.1]):
        m = mirror_of(rt("c", bad), 0.0)
        assert (m.ttft_slo_s, m.tpot_slo_s) == (DEFAULT_TTFT_SLO_S, DEFAULT_TPOT_SLO_S), bad
    rig = fair_rig("bros", {})
    fair = rig.scheduler.policy
    clock = [0.0]
    fair.ledger.clock = lambda: clock[0]
    for rid, slo, at in (("loose", None, 0.0), ("tight", [0.1, 0.2], 0.2)):
        clock[0] = at
        r = rt(rid, slo)
        fair.ledger.arrived(r)
        rig.queue(r)
    clock[0] = 0.25  # loose: 0.15 s left; tight: 0.05 s left
    assert [r.rid for r in rig.admit()] == ["tight", "loose"]


def test_the_routers_count_of_calls_in_flight_reaches_the_mirror():
    """``Request.cluster_inflight`` through the bridge's body and SGLang's own
    ``SamplingParams`` to the ledger's mirror; a value our router never sends is ignored."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_fair.request import INFLIGHT_PARAM, Request
    from sgl_fair.worker.sglang.http_api import generate_body
    from sgl_fair.worker.sglang.mirror import mirror_of

    def sent(inflight=None, params=None):
        call = Request(rid="x", client="u", input_ids=(7, 8, 9), output_len=4, arrival_s=0.0,
                       cluster_inflight=inflight, sampling=params)  # fmt: skip
        body = generate_body(call, inflight=True)
        r = make_req(body["input_ids"], body["routing_key"], rid="x")
        r.sampling_params = SamplingParams(**body["sampling_params"])
        return r

    assert mirror_of(sent(24), 0.0).cluster_inflight == 24
    assert mirror_of(sent(), 0.0).cluster_inflight is None
    for bad in (0, -1, "3", 2.0, 10**9, True):  # a client's own value never gets through...
        assert (
            mirror_of(sent(None, {"custom_params": {INFLIGHT_PARAM: bad}}), 0.0).cluster_inflight
            is None
        )
        r = make_req([7, 8, 9], "u", rid="g")  # ...and one sent to SGLang directly is ignored
        r.sampling_params = SamplingParams(max_new_tokens=4, custom_params={INFLIGHT_PARAM: bad})
        assert mirror_of(r, 0.0).cluster_inflight is None


def test_a_fairserve_calls_interaction_reaches_the_plugin_through_the_bridge():
    """Before, ``interaction_id`` and ``app`` never reached SGLang: FairServe inside the
    plugin took every call as the start of its own interaction, and refused the second call
    of an interaction under way while overloaded. The bridge's body (``CALL_PARAM`` in
    ``custom_params``), through SGLang's own ``SamplingParams``, carries them now."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_fair.request import CALL_PARAM, Request
    from sgl_fair.worker.sglang.http_api import generate_body
    from sgl_fair.worker.sglang.mirror import mirror_of

    def sent(rid: str, iid: str, **fields):
        call = Request(rid=rid, client="u", input_ids=(7, 8, 9), output_len=4, arrival_s=0.0,
                       interaction_id=iid, app="agent", **fields)  # fmt: skip
        body = generate_body(call)
        r = make_req(body["input_ids"], body["routing_key"], rid=rid)
        r.sampling_params = SamplingParams(**body["sampling_params"])
        return r

    m = mirror_of(sent("x", "i-1", stage=2, system_len=1, oit_checked=True), 0.0)
    assert (m.interaction_id, m.app, m.stage, m.system_len, m.oit_checked) == (
        "i-1", "agent", 2, 1, True)  # fmt: skip
    garbage = make_req([7, 8, 9], "u", rid="g")
    garbage.sampling_params = SamplingParams(
        max_new_tokens=4,
        custom_params={
            CALL_PARAM: {
                "interaction": 5,
                "app": "x" * 300,
                "stage": -1,
                "system_len": "2",
                "oit_checked": 1,
            }
        },
    )
    m = mirror_of(garbage, 0.0)
    assert (m.interaction_id, m.app, m.stage, m.system_len, m.oit_checked) == (
        None, None, 0, None, False)  # fmt: skip
    rig = fair_rig("fairserve", {"max_waiting": 0, "limits": {"user_limit": 1, "window_s": 60}})
    fair = rig.scheduler.policy
    for rid, iid in (("a1", "A"), ("b1", "B"), ("a2", "A")):
        r = sent(rid, iid)
        fair.ledger.arrived(r)
    assert set(fair.ledger.mirrors) == {"a1", "a2"}  # overloaded, over the limit: a new
    assert fair.ledger.num_rejected == 1  # interaction refused, never a call of one under way
