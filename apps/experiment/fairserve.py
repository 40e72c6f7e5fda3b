"""``fairserve-apps``: the FairServe paper's setting on one simulated worker (SPEC §4, §7).

More than 1,000 users over four apps with distinct token profiles and interaction graphs::

    chat   1 call                          short prompts, medium outputs
    agent  3-10 calls, one after another   each call's prompt extends the previous one
    tot    1 -> 2-4 in parallel -> 1       Tree-of-Thoughts: root, branches, merge
    judge  2-4 in parallel -> 1            LLM-as-judge: long document, short verdicts

Each user belongs to one app and starts interactions as a Poisson process at a rate drawn
inside its app's normal range; a few *abusive* users start them 20x faster than the top of
that range. An interaction is closed-loop: a level's calls are issued when the previous
level's calls have all finished; a rejected call ends the interaction (its other calls run to
completion — the tokens they used are *wasted*). Two phases: the first half *overloaded*
(every benign user at the scenario's ``overload_factor`` x its rate), the second
*underloaded* (benign users at ``UNDERLOAD_FACTOR`` x; abusive users keep their rate).

Three scenarios on the same users (each row names its ``scenario``; ``--scenario NAME``
picks one, ``paper`` by default):

* ``paper`` (``fairserve_paper.py``): every app's interactions sized as the paper's trace
  (Table 2: 73 % one call, 26 % 2-10, a tail to 30) in Figure 1's shape (decompose, agents
  in parallel, aggregate: the agents' calls arrive in a burst), benign users offered
  ``abuse-overload``'s expected load, and rpm's limit the 99th percentile of the benign
  users' own requests per minute (Figure 2a) instead of rpm's default 20.
* ``benign-overload``: benign users at 0.6x — in the overloaded phase their load *alone*
  is about what the GPU serves (KV pool ~90 % full for most of the phase even when the abusers
  are throttled to their limits), so calls queue whatever the policy does.
* ``abuse-overload``: benign users at 0.45x — their load alone fits with room to spare and
  the abusers' push it over: the FairServe paper's premise (§5: abusive users take the
  capacity benign users need).

The ``offered`` block gives each scenario's offered load per phase (expected input + output
tokens of the interactions that start in it, benign and abusive) and ``premises`` checks
each scenario's premise against what the policies served; rows give the load each policy
served per phase.

Row fields (per policy):

* ``tokens_wasted``: input + output tokens of finished calls of interactions that were
  later throttled; ``tokens_to_abusive``: tokens served to abusive users;
* ``interactions_throttled``, ``benign_users_throttled``, ``abusive_users_throttled``,
  ``abusive_throttled_in_overload`` (of the abusive users that sent in the overloaded
  phase), ``throttled_while_underloaded`` (rejections in the underloaded phase);
* ``users_served_pct``: users with >= 1 completed interaction and none throttled, over the
  users that started any; ``users_queued_pct``: users with a call that waited more than
  ``QUEUED_S`` in the waiting queue;
* ``queue_delay_p50_s``/``_p99_s``: a call's time in the waiting queue (``Request.queue_s``,
  every wait summed, a retracted call's re-queue included; one still waiting: until the end),
  ``ttft_p50_s``, ``throughput_tok_s`` (input + output tokens of finished calls / duration);
  ``served_overloaded_tok_s`` / ``served_underloaded_tok_s``: the same tokens counted in the
  phase the call finished in, over that phase's length; ``computed_overloaded_tok_s`` /
  ``computed_underloaded_tok_s``: what the GPU computed per phase (uncached prompt tokens +
  decode tokens of the steps that started in it; less for the same service = more prefix
  cache hits).

``--quick`` runs the same rates for a shorter time (the phases keep their halves).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_fair.experiment.fairserve_paper import paper_levels, paper_overload_factor
from sgl_fair.experiment.fairserve_report import (
    benign_rpm_limit,
    make_row,
    offered_load,
    premises,
    targets,
)
from sgl_fair.experiment.registry import ExperimentEntry, ExperimentOutput, RunOptions, register
from sgl_fair.experiment.show import print_rows
from sgl_fair.policies import PolicyCaps, make_policy
from sgl_fair.policies.rpm import RPM
from sgl_fair.request import Phase, Request
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.loop import SimLoop
from sgl_fair.worker.sim.runner import make_sim_worker

NAME = "fairserve-apps"
FIGURE = "FairServe T3"
DESCRIPTION = (
    "1,000+ users over chat/agent/ToT/judge apps, a few abusive users; overloaded then "
    "underloaded: RPM vs VTC vs FairServe-W (WSC) vs FairServe (WSC + OIT)."
)
GPU, MODEL, KV_TOKENS = "A10G-24GB", "Llama-3.1-8B", None
DURATION_S, QUICK_DURATION_S = 600.0, 180.0
NUM_USERS, NUM_ABUSIVE = 1000, 6
UNDERLOAD_FACTOR, ABUSE_FACTOR = 0.1, 20.0
VOCAB = 32_000


@dataclass(frozen=True)
class AppProfile:
    name: str
    share: float  # of the users
    system_len: int
    input_len: tuple[int, int]  # a call's prompt beyond the system prompt (uniform)
    output_len: tuple[int, int]
    rate_per_min: tuple[int | float, int | float]  # benign interactions per user per minute
    levels: Callable[[np.random.Generator], list[int]]  # calls per level

    def expected_tokens(self) -> float:
        """α·N̄_I + β·N̄_S + γ·N̄_O with FairServe's defaults: the config seed of w."""
        return sum(self.input_len) / 2 + 2 * self.system_len + sum(self.output_len) / 2


APPS: tuple[AppProfile, ...] = (
    AppProfile("chat", 0.55, 120, (40, 400), (40, 300), (0.2, 1.0), lambda g: [1]),
    AppProfile(
        "agent", 0.2, 400, (100, 300), (20, 120), (0.1, 0.4), lambda g: [1] * int(g.integers(3, 11))
    ),
    AppProfile(
        "tot",
        0.1,
        200,
        (100, 300),
        (100, 250),
        (0.05, 0.2),
        lambda g: [1, int(g.integers(2, 5)), 1],
    ),
    AppProfile(
        "judge", 0.15, 300, (800, 1500), (10, 60), (0.1, 0.4), lambda g: [int(g.integers(2, 5)), 1]
    ),
)


@dataclass(frozen=True)
class Scenario:
    """Benign users' rate factor in the overloaded phase; ``paper``: Table 2's interaction
    sizes in Figure 1's shape (else each app's own graph) and rpm's limit from the benign
    users' 99th-percentile RPM (else rpm's default)."""

    name: str
    overload_factor: float
    paper: bool = False
    benign_fits: bool = True  # premise: the benign load alone is below what is served


def _mean_calls(app: AppProfile) -> float:
    rng = np.random.default_rng(0)
    return float(np.mean([sum(app.levels(rng)) for _ in range(4000)]))


_PAPER_FACTOR = paper_overload_factor(
    0.45,
    [
        (
            a.share * sum(a.rate_per_min) / 2,
            _mean_calls(a),
            sum(a.input_len) / 2 + a.system_len + sum(a.output_len) / 2,
        )
        for a in APPS
    ],
)
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("paper", round(_PAPER_FACTOR, 3), paper=True),
        Scenario("benign-overload", 0.6, benign_fits=False),
        Scenario("abuse-overload", 0.45),
    )
}
DEFAULT_SCENARIO = "paper"
RPM_DEFAULT_LIMIT = RPM.Config().limit  # rpm's own default (20 per minute)
OVERLOAD_FACTOR = SCENARIOS["benign-overload"].overload_factor


@dataclass(frozen=True)
class User:
    name: str
    app: AppProfile
    rate_per_s: float
    abusive: bool


@dataclass
class Interaction:
    iid: str
    user: User
    start_s: float
    levels: list[int]
    context: tuple[int, ...]
    level: int = 0
    outstanding: int = 0
    throttled: bool = False
    done: bool = False
    calls: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class PolicyCase:
    label: str
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


def policies(rpm_limit: int | None = None) -> tuple[PolicyCase, ...]:
    """RPM's limit is ``rpm_limit`` per minute, else its own default (20); FairServe knows
    the apps' system prompts and seeds w from their profiles; its user/app limits are
    derived from history."""
    fs = {
        "system_lens": {a.name: a.system_len for a in APPS},
        "stage_weights": {a.name: a.expected_tokens() for a in APPS},
    }
    return (
        PolicyCase("rpm", "rpm", {} if rpm_limit is None else {"limit": rpm_limit}),
        PolicyCase("vtc", "vtc"),
        PolicyCase("fairserve-w", "fairserve-w", fs),
        PolicyCase("fairserve", "fairserve", fs),
    )


# ---------------------------------------------------------------- workload


def make_users(rng: np.random.Generator) -> list[User]:
    shares = np.array([a.share for a in APPS])
    apps = rng.choice(len(APPS), size=NUM_USERS, p=shares / shares.sum())
    abusive = set(rng.choice(NUM_USERS, size=NUM_ABUSIVE, replace=False).tolist())
    users = []
    for i, a in enumerate(apps):
        app = APPS[int(a)]
        lo, hi = app.rate_per_min
        rate = hi * ABUSE_FACTOR if i in abusive else rng.uniform(lo, hi)
        users.append(User(f"user{i:04d}", app, rate / 60.0, i in abusive))
    return users


def make_interactions(
    users: list[User], duration_s: float, seed: int, scenario: str | Scenario = "benign-overload"
) -> list[Interaction]:
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    rng = np.random.default_rng(seed + 1)
    half = duration_s / 2
    out: list[Interaction] = []
    for user in users:
        phases = ((0.0, half, sc.overload_factor), (half, duration_s, UNDERLOAD_FACTOR))
        for t0, t1, factor in phases:
            rate = user.rate_per_s * (1.0 if user.abusive else factor)
            t = t0 + rng.exponential(1 / rate)
            while t < t1:
                app = user.app
                ctx_len = app.system_len + app.input_len[1] + 8 * 16
                body = rng.integers(1, VOCAB, size=ctx_len - app.system_len)
                context = _system_prompt(app) + tuple(body.tolist())
                iid = f"{user.name}/{len(out)}"
                levels = paper_levels(rng) if sc.paper else app.levels(rng)
                out.append(Interaction(iid, user, float(t), levels, context))
                t += rng.exponential(1 / rate)
    out.sort(key=lambda i: i.start_s)
    return out


def _system_prompt(app: AppProfile) -> tuple[int, ...]:
    base = 1 + APPS.index(app) * 1000  # the same for every user of the app (cacheable)
    return tuple(range(base, base + app.system_len))


# ---------------------------------------------------------------- one run


def run_case(
    case: PolicyCase,
    interactions: list[Interaction],
    duration_s: float,
    seed: int,
    scenario: str = "benign-overload",
) -> dict[str, Any]:
    policy = make_policy(case.name, **dict(case.options))
    cost_model = CostModel.from_names(GPU, MODEL)
    sched, engine = make_sim_worker(
        policy=policy, cost_model=cost_model, kv_tokens=KV_TOKENS, config=SchedulerConfig()
    )
    kv = sched.kv
    attach = PolicyCaps.of(policy).attach_load
    if attach is not None:  # OIT's overload signal: KV held by requests (not evictable cache)
        attach(lambda: 1.0 - kv.available_tokens() / kv.capacity_tokens)
    rng = np.random.default_rng(seed + 2)
    fresh = [_fresh(i) for i in interactions]
    pending: list[tuple[float, int, Interaction]] = [(i.start_s, n, i) for n, i in enumerate(fresh)]
    heapq.heapify(pending)
    owner: dict[int, Interaction] = {}
    seq = itertools.count(len(fresh))
    rejections: list[tuple[float, Interaction]] = []
    done_seen = 0
    half = duration_s / 2
    computed = [0, 0]  # prompt tokens computed + decode tokens, per phase (by step start)
    wall0 = time.perf_counter()

    def issue(inter: Interaction, t: float) -> None:
        for req in level_calls(inter, rng, t):
            owner[id(req)] = inter
            if sched.add_request(req, t) is not None:
                inter.throttled = True
                rejections.append((t, inter))
                inter.outstanding -= 1
        if inter.outstanding == 0:
            inter.done = True

    class Levels:  # the arrival source: each interaction's next level, when it is due
        def release(self, now: float, _sched: Any) -> None:
            while pending and pending[0][0] <= now:
                t, _, inter = heapq.heappop(pending)
                issue(inter, t)

        def next_s(self) -> float | None:
            return pending[0][0] if pending else None

    def on_step(loop: SimLoop, batch: Any, result: Any, start_s: float) -> None:
        nonlocal done_seen
        computed[0 if start_s < half else 1] += batch.num_prefill_tokens + len(batch.decode)
        for req in sched.log.done[done_seen:]:
            inter = owner.get(id(req))
            if inter is None or req.phase is not Phase.FINISHED:
                continue
            inter.outstanding -= 1
            if inter.outstanding == 0:
                inter.level += 1
                if inter.throttled or inter.level == len(inter.levels):
                    inter.done = not inter.throttled
                else:
                    heapq.heappush(pending, (loop.now, next(seq), inter))
        done_seen = len(sched.log.done)

    SimLoop(sched, engine, Levels(), until_s=duration_s, on_step=on_step).run()
    wall = time.perf_counter() - wall0
    row = make_row(case.label, fresh, rejections, duration_s, wall)
    for i, phase in enumerate(("overloaded", "underloaded")):
        row[f"computed_{phase}_tok_s"] = round(computed[i] / half, 1)
    return {"scenario": scenario, **row}


def level_calls(inter: Interaction, rng: np.random.Generator, t: float) -> list[Request]:
    """The calls of ``inter``'s current level, issued at ``t`` (recorded in ``inter.calls``;
    ``inter.outstanding`` set to their number)."""
    app = inter.user.app
    n = inter.levels[inter.level]
    inter.outstanding = n
    out = []
    for _ in range(n):
        n_in = int(rng.integers(*app.input_len)) + app.system_len + 8 * inter.level
        prompt = inter.context[: n_in - 1] + (VOCAB + len(inter.calls),)
        req = Request(
            f"{inter.iid}/{len(inter.calls)}",
            inter.user.name,
            prompt,
            int(rng.integers(*app.output_len)),
            t,
            interaction_id=inter.iid,
            app=app.name,
            stage=inter.level,
        )
        inter.calls.append(req)
        out.append(req)
    return out


def _fresh(i: Interaction) -> Interaction:
    return Interaction(i.iid, i.user, i.start_s, list(i.levels), i.context)


# ---------------------------------------------------------------- the experiment


def run(
    *,
    quick: bool = False,
    seed: int = 0,
    dp: int = 1,
    scenarios: tuple[str, ...] = (DEFAULT_SCENARIO,),
) -> dict[str, Any]:
    """One worker (``dp`` 1), or a cluster of ``dp`` behind the router (``fairserve_cluster``);
    ``scenarios``: names in ``SCENARIOS``, run in that order on the same users."""
    from .fairserve_cluster import run_case_cluster, scaled_users

    duration = QUICK_DURATION_S if quick else DURATION_S
    wall0 = time.perf_counter()
    users = make_users(np.random.default_rng(seed))
    if dp > 1:
        users = scaled_users(users, dp)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    checked: list[dict[str, Any]] = []
    offered: dict[str, dict[str, float]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for scenario in scenarios:
        sc = SCENARIOS[scenario]
        interactions = make_interactions(users, duration, seed, sc)
        limit = benign_rpm_limit(interactions, duration) if sc.paper else None
        settings[scenario] = {
            "overload_factor": sc.overload_factor,
            "interaction_sizes": "table2-figure1" if sc.paper else "apps",
            "rpm_limit_per_min": limit if limit is not None else RPM_DEFAULT_LIMIT,
            "rpm_limit_from": "benign users' p99 RPM" if sc.paper else "rpm's default",
        }
        offered[scenario] = {
            "overload_factor": sc.overload_factor,
            **offered_load(interactions, duration),
        }
        by_policy = {
            c.label: (
                run_case(c, interactions, duration, seed, scenario)
                if dp == 1
                else run_case_cluster(c, interactions, duration, seed, dp, scenario)
            )
            for c in policies(limit)
        }
        rows.extend(by_policy.values())
        checks.extend(targets(by_policy, scenario))
        checked.extend(premises(scenario, offered[scenario], by_policy, sc.benign_fits))
    return {
        "experiment": NAME,
        "figure": FIGURE,
        "description": DESCRIPTION,
        "quick": quick,
        "seed": seed,
        "duration_s": duration,
        "worker": {"gpu": GPU, "model": MODEL, "kv_tokens": KV_TOKENS},
        "dp": dp,
        "num_users": NUM_USERS,
        "num_abusive": NUM_ABUSIVE,
        "apps": [a.name for a in APPS],
        "scenarios": settings,
        "offered": offered,
        "premises": checked,
        "rows": rows,
        "claims": checks,
        "all_claims_passed": all(c["passed"] for c in checks) if checks else None,
        "sim_wall_s": round(time.perf_counter() - wall0, 3),
    }


# ---------------------------------------------------------------- the experiment registry


def _check(flags: Mapping[str, Any]) -> None:
    scenario = flags.get("scenario")
    if scenario is not None and scenario not in SCENARIOS:
        known = " | ".join(SCENARIOS)
        raise ValueError(f"--scenario for {NAME} must be {known} (got {scenario!r})")


def _run(o: RunOptions) -> ExperimentOutput:
    """``--dp``: over a cluster behind the router, with its OIT for fairserve;
    ``--scenario``: one of ``SCENARIOS``, ``paper`` by default."""
    dp, scenario = o.flags.get("dp") or 1, o.flags.get("scenario") or DEFAULT_SCENARIO
    data = run(quick=o.quick, seed=o.seed, dp=dp, scenarios=(scenario,))
    return ExperimentOutput.from_json(ENTRY, data)


def _show(result: ExperimentOutput, paths: dict) -> None:
    header = list(TABLE_COLUMNS)
    body = [[_fmt(row[k]) for k in header] for row in result.rows]
    print_rows(f"{NAME} ({FIGURE}) — {DESCRIPTION}", header, body)
    for claim in result.extras["premises"]:
        print(f"  [{'ok' if claim['passed'] else 'NOT MET'}] premise {claim['text']}")
    for c in result.claims:
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['text']} — {c['detail']}")
    print(f"results: {paths['results']}")


TABLE_COLUMNS = (
    "scenario",
    "policy",
    "tokens_wasted",
    "interactions_throttled",
    "benign_users_throttled",
    "abusive_users_throttled",
    "users_served_pct",
    "users_queued_pct",
    "queue_delay_p99_s",
    "ttft_p50_s",
    "throughput_tok_s",
    "served_overloaded_tok_s",
)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) and abs(v) < 100 else str(v)


ENTRY = register(
    ExperimentEntry(
        NAME, FIGURE, DESCRIPTION, _run, quick={"duration_s": QUICK_DURATION_S},
        flags=frozenset(("dp", "scenario")), check=_check, show=_show,
    ),
    family=__name__,
)  # fmt: skip
