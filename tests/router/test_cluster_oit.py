"""FairServe's OIT at the router (``router/oit.py``): the worker's rules over the cluster.

Counts aggregate over every worker; the cluster is overloaded from the workers' fresh ``Load``
reports only; a call of an interaction in flight is never refused; the refusal is the one a
worker sends (HTTP 429 with the limit named). The live HTTP half is in
``test_cluster_oit_http.py``."""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

import pytest

from sgl_fair.messages import Finished, FinishReason, Load
from sgl_fair.policies import make_policy
from sgl_fair.policies.base import Rejection
from sgl_fair.request import Phase, Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router import protocol as P
from sgl_fair.router.oit import ClusterOIT, ClusterOITConfig, refusal
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cluster import ClusterConfig, simulate_cluster

_rids = itertools.count()
CAP = 1000


def req(client: str = "mallory", iid: str | None = None, app: str | None = "spam", t=0.0):
    return Request(
        rid=f"r{next(_rids)}", client=client, input_ids=(1, 2, next(_rids) + 10),
        output_len=4, arrival_s=t, interaction_id=iid, app=app,
    )  # fmt: skip


@dataclass
class View:
    """A fake router: ``n`` alive workers and the Load reports it has taken (and when)."""

    n: int = 4
    loads: dict[int, Load] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(range(self.n))

    def load(self, w: int) -> Load | None:
        return self.loads.get(w)

    def load_seen_s(self, w: int) -> float | None:
        return self.seen.get(w)

    def report(self, w: int, now: float, *, waiting: int = 0, kv: float = 0.0) -> None:
        self.loads[w] = Load(w, now, waiting, 1, int(kv * CAP), 0, CAP)
        self.seen[w] = now

    def all(self, now: float, **kw) -> None:
        for w in self.workers:
            self.report(w, now, **kw)


def oit(**limits) -> ClusterOIT:
    return ClusterOIT(max_waiting=0, limits={"user_limit": 4, "window_s": 60, **limits})


def test_counts_aggregate_over_workers_the_router_throttles_at_the_limit():
    """A user's calls spread over 4 workers: each worker's own OIT (same limit, overloaded
    too) sees at most 2 of them and lets them all in; the router sees all 5 and refuses the
    5th, with the worker's structured rejection."""
    router = Router(make_router_policy("rr"), 4, oit=oit())
    locals_ = [make_policy("fairserve", max_waiting=0, limits={"user_limit": 4}) for _ in range(4)]
    for p in locals_:
        p.attach_load(lambda: 1.0)  # every worker overloaded as well
    got = []
    for i in range(5):
        r = req(t=1.0 + i)
        for w in range(4):  # fresh reports: one request waits on every worker
            router.handle(Load(w, r.arrival_s, 1, 1, 900, 0, CAP), r.arrival_s)
        rejection = router.throttle(r, r.arrival_s)
        got.append(rejection)
        if rejection is None:
            d = router.dispatch(r, r.arrival_s)
            assert locals_[d.worker].on_arrival(r, r.arrival_s) is None  # under it locally
    assert got[:4] == [None] * 4
    rej = got[4]
    assert isinstance(rej, Rejection)
    assert (rej.limit, rej.limit_max, rej.limit_window_s) == ("user", 4, 60.0)
    assert "over its limit of 4 requests per 60 s" in rej.reason
    assert rej.retry_after_s == pytest.approx(60.0 - 3.0)  # the 2nd arrival leaves the window
    assert max(p.windows.user_count("mallory", "spam", 5.0) for p in locals_) <= 2
    assert router.oit.num_throttled == 1


def test_never_mid_interaction():
    view = View()
    view.all(0.0, waiting=3)
    o = oit(user_limit=1)
    assert o.on_arrival(req(iid="a", t=0.0), 0.0, view) is None
    for t in (1.0, 2.0, 3.0, 4.0):  # over the limit, overloaded: the interaction goes on
        view.all(t, waiting=3)
        assert o.on_arrival(req(iid="a", t=t), t, view) is None
    # ... while a new interaction of the same user, or a call with no interaction, is refused
    assert o.on_arrival(req(iid="b", t=4.0), 4.0, view).limit == "user"
    assert o.on_arrival(req(iid=None, t=4.0), 4.0, view).limit == "user"
    # a refused start does not start the interaction: its next call is refused too
    assert o.on_arrival(req(iid="b", t=4.5), 4.5, view) is not None


def test_an_interaction_ends_after_the_idle_timeout_and_a_finish_keeps_it_alive():
    view = View()
    o = ClusterOIT(max_waiting=0, interaction_timeout_s=10, limits={"user_limit": 0})
    view.all(0.0)  # not overloaded: let the first calls in
    first = req(iid="long", t=0.0)
    assert o.on_arrival(first, 0.0, view) is None
    idle = req(iid="idle", t=0.0)
    assert o.on_arrival(idle, 0.0, view) is None
    o.on_finished(idle.rid, 0.0)  # (a call in flight keeps its interaction alive: finish it)
    o.on_finished(first.rid, 25.0)  # a long call: its interaction was active until 25 s
    view.all(30.0, waiting=1)
    assert o.on_arrival(req(iid="long", t=30.0), 30.0, view) is None  # 5 s after the finish
    assert o.on_arrival(req(iid="idle", t=30.0), 30.0, view) is not None  # idle 30 s: new


def test_never_while_the_cluster_is_not_overloaded():
    view = View()
    o = oit()
    for i in range(20):  # 5x over the limit, but the cluster has room
        view.all(float(i), waiting=0, kv=0.5)
        assert o.on_arrival(req(t=float(i)), float(i), view) is None
    view.all(20.0, waiting=1, kv=0.5)  # now something waits
    assert o.on_arrival(req(t=20.0), 20.0, view) is not None
    assert o.num_arrivals == 21 and o.num_throttled == 1


def test_stale_or_missing_load_never_throttles():
    o = oit(user_limit=0)
    view = View()
    assert not o.overloaded(view, 0.0)
    assert o.on_arrival(req(), 0.0, view) is None  # no report at all
    view.all(0.0, waiting=1000, kv=1.0)
    assert o.overloaded(view, 2.0)
    assert not o.overloaded(view, 2.5)  # every report older than stale_after_s (2 s)
    assert o.on_arrival(req(t=10.0), 10.0, view) is None
    # one fresh report, three missing: the missing count as idle workers (the mean rule); the
    # one that reported is overloaded itself (the default rule: any one worker)
    view = View()
    view.report(0, 10.0, kv=1.0)
    assert o.cluster_load(view, 10.0).kv_usage == pytest.approx(0.25)
    assert o.overloaded(view, 10.0)
    mean = ClusterOIT(max_waiting=0, overload="mean")
    assert not mean.overloaded(view, 10.0)
    # no workers alive
    assert not o.overloaded(View(n=0), 0.0)


def test_overload_rule_mean_kv_or_waiting_per_worker():
    o = ClusterOIT(max_waiting=2, kv_threshold=0.8, overload="mean")
    view = View()
    view.all(0.0, kv=0.79)
    assert not o.overloaded(view, 0.0)
    view.report(0, 0.0, kv=1.0)  # mean (1 + 3 x 0.79) / 4 = 0.84
    assert o.overloaded(view, 0.0)
    view.all(0.0, waiting=2)  # 8 waiting = 2 per worker: not more than max_waiting x n
    assert not o.overloaded(view, 0.0)
    view.report(3, 0.0, waiting=3)
    assert o.overloaded(view, 0.0)


def test_overload_rule_any_one_worker_by_the_worker_rule():
    """``overload="any"``: one hot worker (its own queue over max_waiting, or its KV at the
    threshold) overloads the cluster while the others idle, where the mean rule does not;
    stale reports still count as idle."""
    mean, any_ = (ClusterOIT(max_waiting=2, kv_threshold=0.8, overload=r) for r in ("mean", "any"))
    view = View()
    view.all(0.0)
    view.report(1, 0.0, waiting=3)  # 3 waiting on one worker: over its bound of 2
    assert any_.overloaded(view, 0.0) and not mean.overloaded(view, 0.0)
    view.all(0.0, waiting=2)
    view.report(2, 0.0, kv=0.8)
    assert any_.overloaded(view, 0.0) and not mean.overloaded(view, 0.0)
    view.report(2, 0.0, kv=0.79)
    assert not any_.overloaded(view, 0.0)
    view.report(2, 0.0, kv=1.0)
    assert not any_.overloaded(view, 10.0)  # every report is stale by then
    load = any_.cluster_load(view, 0.0)
    assert (load.busiest_waiting, load.busiest_kv_usage, load.num_waiting) == (2, 1.0, 6)


def test_same_decisions_as_the_worker_oit_on_one_worker():
    """With every arrival at one worker, the router's OIT refuses exactly what the worker's
    refuses, with the same rejection (the rules are the worker's)."""
    rng = random.Random(7)
    policy = make_policy(
        "fairserve", max_waiting=10**9, interaction_timeout_s=5.0,
        limits={"user_limit": 3, "window_s": 10, "app_limits": {"spam": 8}},
    )  # fmt: skip
    overloaded = [False]
    policy.attach_load(lambda: 1.0 if overloaded[0] else 0.0)
    o = ClusterOIT(
        max_waiting=10**9, interaction_timeout_s=5.0,
        limits={"user_limit": 3, "window_s": 10, "app_limits": {"spam": 8}},
    )  # fmt: skip
    view = View(n=1)
    t = 0.0
    refused = 0
    for _ in range(400):
        t += rng.expovariate(2.0)
        overloaded[0] = rng.random() < 0.7
        view.report(0, t, kv=1.0 if overloaded[0] else 0.0)
        iid = rng.choice([None, *(f"i{k}" for k in range(6))])
        r = req(rng.choice(["a", "b", "c"]), iid, rng.choice(["spam", "chat"]), t)
        worker, router = policy.on_arrival(r, t), o.on_arrival(r, t, view)
        assert worker == router, (t, r)
        refused += worker is not None
    assert refused > 20  # the sequence really exercises throttling


def test_the_refusal_is_the_workers_finished():
    rej = Rejection("user 'm' over its limit", 12.5, "user", 4, 60.0)
    r = req()
    fin = refusal(r, rej, 3.0)
    assert fin.reason is FinishReason.REJECTED and fin.worker == -1 and not fin.ok
    assert (fin.rid, fin.error, fin.retry_after_s) == (r.rid, rej.reason, 12.5)
    assert P.throttle_of(fin.limit) == P.Throttle("user", 4, 60.0)
    assert Router(make_router_policy("rr"), 2).throttle(r, 0.0) is None  # no OIT: all admitted


def test_router_tracks_load_receipt_and_forgets_dead_workers():
    router = Router(make_router_policy("rr"), 2, oit=oit())
    router.handle(Load(0, 100.0, 5, 1, 0, 0, CAP), 3.0)  # the worker's clock is off
    assert router.load_seen_s(0) == 3.0 and router.load_seen_s(1) is None
    assert router.oit.overloaded(router, 4.0)  # judged by receipt, not the worker's stamp
    router.remove_worker(0)
    assert router.load_seen_s(0) is None
    assert not router.oit.overloaded(router, 4.0)


def test_finished_through_the_router_refreshes_the_interaction():
    router = Router(make_router_policy("rr"), 1, oit=ClusterOIT(
        max_waiting=0, interaction_timeout_s=10, limits={"user_limit": 0}))  # fmt: skip
    r = req(iid="agent-1", t=0.0)
    assert router.throttle(r, 0.0) is None
    d = router.dispatch(r, 0.0)
    fin = Finished(d.worker, 20.0, r.rid, r.client, FinishReason.LENGTH, r.input_ids, (5,))
    router.handle(fin, 20.0)
    router.handle(Load(0, 24.0, 1, 0, 0, 0, CAP), 24.0)  # overloaded now
    assert router.throttle(req(iid="agent-1", t=25.0), 25.0) is None  # 5 s after its finish
    assert router.throttle(req(iid="agent-2", t=25.0), 25.0) is not None


@pytest.mark.parametrize(
    "opts",
    [{"kv_threshold": 0}, {"kv_threshold": 1.5}, {"max_waiting": -1}, {"stale_after_s": 0},
     {"interaction_timeout_s": -1}, {"bogus": 1}, {"limits": {"window_s": 0}},
     {"limits": {"nope": 1}}, {"limits": 5}, {"overload": "max"}],
)  # fmt: skip
def test_bad_options_are_one_line_errors(opts):
    with pytest.raises(ValueError, match="cluster OIT"):
        ClusterOITConfig.from_options(**opts)


def test_the_cluster_simulator_records_router_refusals():
    """simulate_cluster asks the router's ``throttle`` first: a refused call is recorded rejected
    (with its limit) and never reaches a worker; a benign interaction runs to the end."""
    cap = 4
    router = Router(
        make_router_policy("rr"), 2,
        oit=ClusterOIT(max_waiting=0, limits={"user_limit": cap, "window_s": 60}),
    )  # fmt: skip
    flood = [
        Request(rid=f"m{i}", client="mallory", input_ids=tuple(range(i, i + 64)),
                output_len=200, arrival_s=0.05 * i, app="spam")
        for i in range(40)
    ]  # fmt: skip
    benign = [
        Request(rid=f"a{i}", client="alice", input_ids=tuple(range(900, 964)), output_len=8,
                arrival_s=0.5 * i, interaction_id="alice-1", app="chat", stage=i)
        for i in range(4)
    ]  # fmt: skip
    res = simulate_cluster(
        router=router,
        local_policy=lambda _w: make_policy("fcfs"),
        config=ClusterConfig(dp=2, gpu="A10G-24GB", model="Llama-3.2-3B", kv_tokens=20000,
                             scheduler=SchedulerConfig(max_running_requests=1)),
        requests=flood + benign,
        check_every=50,
    )  # fmt: skip
    refused = [r for r in res.submitted if r.phase is Phase.REJECTED]
    assert refused and all(r.client == "mallory" for r in refused)
    assert all(r.reject_limit == ("user", cap, 60.0) for r in refused)
    assert all(r.reject_retry_after_s is not None and r.reject_reason for r in refused)
    assert len(refused) == router.oit.num_throttled
    assert sum(res.dispatch_counts()) + len(refused) == len(res.submitted) == 44
    assert res.unfinished == 0
    assert all(r.phase is Phase.FINISHED for r in res.submitted if r.client == "alice")
    first_refused = min(r.arrival_s for r in refused)
    assert first_refused > 0.0  # not before a Load report said the cluster was overloaded


def test_launch_flags(capsys):
    from sgl_fair.launch.config import parse_config

    cfg = parse_config(["--dp", "2", "--schedule-policy", "fairserve"])
    assert (cfg.cluster_oit, cfg.cluster_oit_opts) == (True, {})  # auto: on with fairserve
    for args in ([], ["--schedule-policy", "fairserve-w"],
                 ["--schedule-policy", "fairserve", "--schedule-policy-opt", "throttle=false"],
                 ["--schedule-policy", "fairserve", "--cluster-oit", "off"]):  # fmt: skip
        assert parse_config(args).cluster_oit is False, args
    cfg = parse_config([
        "--schedule-policy", "fairserve", "--schedule-policy-opt", "max_waiting=8",
        "--schedule-policy-opt", "limits.user_limit=100", "--schedule-policy-opt", "alpha=2",
        "--schedule-policy-opt", "limits.window_s=30",
        "--cluster-oit-opt", "limits.user_limit=4", "--cluster-oit-opt", "stale_after_s=1",
    ])  # fmt: skip
    # fairserve's OIT options carried over (not its WSC ones), --cluster-oit-opt wins
    assert cfg.cluster_oit_opts == {
        "max_waiting": 8, "limits": {"user_limit": 4, "window_s": 30}, "stale_after_s": 1,
    }  # fmt: skip
    cfg = parse_config(["--schedule-policy", "vtc", "--cluster-oit", "on",
                        "--cluster-oit-opt", "kv_threshold=0.5"])  # fmt: skip
    assert (cfg.cluster_oit, cfg.cluster_oit_opts) == (True, {"kv_threshold": 0.5})
    for args, says in [
        (["--cluster-oit-opt", "max_waiting=1"], "the cluster OIT is off"),
        (["--schedule-policy", "fairserve", "--cluster-oit-opt", "kv_threshold=2"], "kv_thr"),
        (["--schedule-policy", "fairserve", "--cluster-oit-opt", "nope=1"], "nope"),
        (["--schedule-policy", "fairserve", "--cluster-oit-opt", "limits.x=1"], "'x'"),
        (["--cluster-oit", "maybe"], "--cluster-oit"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(args)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "--cluster-oit" in err and says in err, err


def test_a_call_the_router_let_through_is_never_refused_by_a_worker():
    """The router judges a call over the whole cluster and marks it ``oit_checked`` (it
    survives the wire); a worker's OIT, which may have seen none of the interaction's other
    calls, lets it through instead of cutting the interaction mid-way."""
    from sgl_fair.messages import Dispatch
    from sgl_fair.transport import decode, encode

    limits = {"user_limit": 1, "window_s": 60}
    policy = make_policy("fairserve", max_waiting=0, limits=limits)  # overloaded: 0 waiting
    policy.attach_load(lambda: 1.0)
    o = ClusterOIT(max_waiting=0, limits=limits)
    view = View(n=2)
    view.all(0.0, kv=1.0)
    first = req("mallory", "judge-1", t=0.0)
    assert o.on_arrival(first, 0.0, view) is None and first.oit_checked
    assert policy.on_arrival(req("mallory", "other", t=0.0), 0.0) is None  # fills the window
    fan = req("mallory", "judge-1", t=0.1)  # a fan-out call this worker has never seen
    assert o.on_arrival(fan, 0.1, view) is None and fan.oit_checked
    wired = decode(encode(Dispatch(1, fan, 0.1))).req
    assert wired.oit_checked
    assert policy.on_arrival(wired, 0.1) is None
    unchecked = req("mallory", "judge-2", t=0.2)  # the same, not through the router's OIT
    assert policy.on_arrival(unchecked, 0.2) is not None
    refused = req("mallory", "judge-3", t=0.3)
    assert o.on_arrival(refused, 0.3, view) is not None and not refused.oit_checked
    # One worker sees every call (and before the router's Load reports): it keeps judging.
    alone = View(n=1)
    alone.all(0.4, kv=0.0)
    solo = req("mallory", "judge-4", t=0.4)
    assert o.on_arrival(solo, 0.4, alone) is None and not solo.oit_checked


def test_replicas_split_the_limits_given():
    """One of 3 replicas behind an even balancer counts a third of each window: the limits
    given are a third of the cluster's (rounded up; 0 stays 0); derived ones scale alone."""
    cfg = ClusterOITConfig.from_options(
        limits={"user_limit": 10, "user_limits": {"chat": 0, "agent": 7}, "app_limits": {"a": 5}}
    )
    third = cfg.split(3).limits
    assert third.user_limit == 4 and third.user_limits == {"chat": 0, "agent": 3}
    assert third.app_limits == {"a": 2} and third.min_limit == 4  # the floor: 10 / 3
    assert cfg.split(1) is cfg
    view = View(n=1)
    view.all(0.0, waiting=3)
    o = ClusterOIT(dataclasses.replace(cfg.split(3), max_waiting=0))
    assert [o.on_arrival(req(t=0.0), 0.0, view) is None for _ in range(5)] == [True] * 4 + [False]


def test_a_replicas_state_splits_the_cluster_oit_limits(tmp_path):
    """``--tenant-limits-split R`` (``--router-replicas`` sets it) splits the cluster OIT's
    limits as it splits the tenants' (the server state builds the OIT from the flags)."""
    from sgl_fair.launch.config import parse_config
    from sgl_fair.router.state import ServerState
    from sgl_fair.router.tokenizer import load_tokenizer

    args = ["--dp", "2", "--schedule-policy", "fairserve", "--cluster-oit-opt",
            "limits.user_limit=9", "--tenant-limits-split", "3"]  # fmt: skip
    state = ServerState.create(
        parse_config(args), tokenizer=load_tokenizer(None), tenants=None,
        ipc_dir=str(tmp_path), kv_capacity_tokens=1000, context_len=1000,
    )  # fmt: skip
    assert state.service.router.oit.config.limits.user_limit == 3  # (no socket opened yet)
