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
(every user at ``OVERLOAD_FACTOR`` x its rate), the second *underloaded* (benign users at
``UNDERLOAD_FACTOR`` x; abusive users keep their rate).

Row fields (per policy):

* ``tokens_wasted``: input + output tokens of finished calls of interactions that were
  later throttled; ``tokens_to_abusive``: tokens served to abusive users;
* ``interactions_throttled``, ``benign_users_throttled``, ``abusive_users_throttled``,
  ``abusive_throttled_in_overload`` (of the abusive users that sent in the overloaded
  phase), ``throttled_while_underloaded`` (rejections in the underloaded phase);
* ``users_served_pct``: users with >= 1 completed interaction and none throttled, over the
  users that started any; ``users_queued_pct``: users with a call that waited more than
  ``QUEUED_S`` before admission (or was never admitted);
* ``queue_delay_p50_s``/``_p99_s`` (arrival -> admission; never admitted: until the end),
  ``ttft_p50_s``, ``throughput_tok_s`` (input + output tokens of finished calls / duration).

``--quick`` runs the same rates for a shorter time (the phases keep their halves).
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sgl_fair.policies import make_policy
from sgl_fair.request import Phase, Request
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
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
OVERLOAD_FACTOR, UNDERLOAD_FACTOR, ABUSE_FACTOR = 0.6, 0.1, 20.0
QUEUED_S = 1.0
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


def policies() -> tuple[PolicyCase, ...]:
    """RPM's limit is its own default (20 per minute); FairServe knows the apps' system
    prompts and seeds w from their profiles; its user/app limits are derived from history."""
    fs = {
        "system_lens": {a.name: a.system_len for a in APPS},
        "stage_weights": {a.name: a.expected_tokens() for a in APPS},
    }
    return (
        PolicyCase("rpm", "rpm"),
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


def make_interactions(users: list[User], duration_s: float, seed: int) -> list[Interaction]:
    rng = np.random.default_rng(seed + 1)
    half = duration_s / 2
    out: list[Interaction] = []
    for user in users:
        for t0, t1, factor in ((0.0, half, OVERLOAD_FACTOR), (half, duration_s, UNDERLOAD_FACTOR)):
            rate = user.rate_per_s * (1.0 if user.abusive else factor)
            t = t0 + rng.exponential(1 / rate)
            while t < t1:
                app = user.app
                ctx_len = app.system_len + app.input_len[1] + 8 * 16
                body = rng.integers(1, VOCAB, size=ctx_len - app.system_len)
                context = _system_prompt(app) + tuple(body.tolist())
                iid = f"{user.name}/{len(out)}"
                out.append(Interaction(iid, user, float(t), app.levels(rng), context))
                t += rng.exponential(1 / rate)
    out.sort(key=lambda i: i.start_s)
    return out


def _system_prompt(app: AppProfile) -> tuple[int, ...]:
    base = 1 + APPS.index(app) * 1000  # the same for every user of the app (cacheable)
    return tuple(range(base, base + app.system_len))


# ---------------------------------------------------------------- one run


def run_case(
    case: PolicyCase, interactions: list[Interaction], duration_s: float, seed: int
) -> dict[str, Any]:
    policy = make_policy(case.name, **dict(case.options))
    cost_model = CostModel.from_names(GPU, MODEL)
    sched, engine = make_sim_worker(
        policy=policy, cost_model=cost_model, kv_tokens=KV_TOKENS, config=SchedulerConfig()
    )
    kv = sched.kv
    attach = getattr(policy, "attach_load", None)
    if attach is not None:  # OIT's overload signal: KV held by requests (not evictable cache)
        attach(lambda: 1.0 - kv.available_tokens() / kv.capacity_tokens)
    rng = np.random.default_rng(seed + 2)
    fresh = [_fresh(i) for i in interactions]
    pending: list[tuple[float, int, Interaction]] = [(i.start_s, n, i) for n, i in enumerate(fresh)]
    heapq.heapify(pending)
    owner: dict[int, Interaction] = {}
    seq = itertools.count(len(fresh))
    rejections: list[tuple[float, Interaction]] = []
    now, done_seen = 0.0, 0
    wall0 = time.perf_counter()

    def issue(inter: Interaction, t: float) -> None:
        app = inter.user.app
        n = inter.levels[inter.level]
        inter.outstanding = n
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
            owner[id(req)] = inter
            if sched.add_request(req, t) is not None:
                inter.throttled = True
                rejections.append((t, inter))
                inter.outstanding -= 1
        if inter.outstanding == 0:
            inter.done = True

    while True:
        while pending and pending[0][0] <= now:
            t, _, inter = heapq.heappop(pending)
            issue(inter, t)
        if now >= duration_s:
            break
        batch = sched.step(now)
        if batch is None:
            if not pending:
                break
            now = pending[0][0]
            continue
        result = engine.run(batch)
        now += result.duration_s
        sched.apply(result, now)
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
                    heapq.heappush(pending, (now, next(seq), inter))
        done_seen = len(sched.log.done)
    wall = time.perf_counter() - wall0
    return _row(case.label, fresh, rejections, duration_s, wall)


def _fresh(i: Interaction) -> Interaction:
    return Interaction(i.iid, i.user, i.start_s, list(i.levels), i.context)


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def _row(
    label: str,
    inters: list[Interaction],
    rejections: list[tuple[float, Interaction]],
    duration_s: float,
    wall_s: float,
) -> dict[str, Any]:
    half = duration_s / 2
    started = [i for i in inters if i.calls]
    calls = [r for i in started for r in i.calls]
    throttled = [i for i in started if i.throttled]
    thr_users = {i.user.name: i.user for i in throttled}
    abusive = {i.user.name for i in started if i.user.abusive}
    abusive_over = {i.user.name for i in started if i.user.abusive and i.start_s < half}
    thr_over = {i.user.name for t, i in rejections if t < half}

    def tokens(r: Request) -> int:
        return r.input_len + r.num_output if r.phase is Phase.FINISHED else 0

    delays, queued_users, ttfts = [], set(), []
    for r in calls:
        if r.phase is Phase.REJECTED:
            continue
        end = r.admit_s if r.admit_s is not None else duration_s
        delays.append(end - r.arrival_s)
        if end - r.arrival_s > QUEUED_S:
            queued_users.add(r.client)
        if r.first_token_s is not None:
            ttfts.append(r.first_token_s - r.arrival_s)
    users = {i.user.name for i in started}
    completed = {i.user.name for i in started if i.done}
    served = completed - set(thr_users)
    return {
        "policy": label,
        "tokens_wasted": sum(tokens(r) for i in throttled for r in i.calls),
        "tokens_to_abusive": sum(tokens(r) for r in calls if r.client in abusive),
        "interactions": len(started),
        "interactions_throttled": len(throttled),
        "benign_users_throttled": sum(1 for u in thr_users.values() if not u.abusive),
        "abusive_users_throttled": sum(1 for u in thr_users.values() if u.abusive),
        "abusive_users": len(abusive),
        "abusive_throttled_in_overload": len(abusive_over & thr_over),
        "abusive_users_in_overload": len(abusive_over),
        "throttled_while_underloaded": sum(1 for t, _ in rejections if t >= half),
        "users": len(users),
        "users_served_pct": round(100 * len(served) / max(len(users), 1), 2),
        "users_queued_pct": round(100 * len(queued_users) / max(len(users), 1), 2),
        "queue_delay_p50_s": _pct(delays, 50),
        "queue_delay_p99_s": _pct(delays, 99),
        "ttft_p50_s": _pct(ttfts, 50),
        "throughput_tok_s": round(sum(tokens(r) for r in calls) / duration_s, 1),
        "sim_wall_s": round(wall_s, 2),
    }


# ---------------------------------------------------------------- the experiment


def targets(rows: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked on this run (reported, never tuned for)."""
    fs, rpm, vtc = rows["fairserve"], rows["rpm"], rows["vtc"]

    def t(text: str, passed: bool, detail: str) -> dict[str, Any]:
        return {"text": text, "passed": bool(passed), "detail": detail}

    ratio = rpm["interactions_throttled"] / max(fs["interactions_throttled"], 1)
    return [
        t("fairserve wastes 0 tokens", fs["tokens_wasted"] == 0, f"{fs['tokens_wasted']}"),
        t(
            "fairserve throttles >= 10x fewer interactions than rpm",
            ratio >= 10,
            f"rpm {rpm['interactions_throttled']} / fairserve {fs['interactions_throttled']}"
            f" = {ratio:.2f}x",
        ),
        t(
            "no benign user throttled",
            fs["benign_users_throttled"] == 0,
            f"{fs['benign_users_throttled']}",
        ),
        t(
            "every abusive user throttled during overload",
            fs["abusive_throttled_in_overload"] == fs["abusive_users_in_overload"],
            f"{fs['abusive_throttled_in_overload']} of {fs['abusive_users_in_overload']}",
        ),
        t(
            "none throttled in the underloaded phase",
            fs["throttled_while_underloaded"] == 0,
            f"{fs['throttled_while_underloaded']}",
        ),
        t(
            "users seeing queueing delay <= 1/5 of vtc's",
            fs["users_queued_pct"] <= vtc["users_queued_pct"] / 5,
            f"fairserve {fs['users_queued_pct']}% vs vtc {vtc['users_queued_pct']}%",
        ),
        t(
            "throughput >= vtc's",
            fs["throughput_tok_s"] >= vtc["throughput_tok_s"],
            f"fairserve {fs['throughput_tok_s']} vs vtc {vtc['throughput_tok_s']} tok/s",
        ),
    ]


def run(*, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    duration = QUICK_DURATION_S if quick else DURATION_S
    wall0 = time.perf_counter()
    users = make_users(np.random.default_rng(seed))
    interactions = make_interactions(users, duration, seed)
    rows = {c.label: run_case(c, interactions, duration, seed) for c in policies()}
    checks = targets(rows)
    return {
        "experiment": NAME,
        "figure": FIGURE,
        "description": DESCRIPTION,
        "quick": quick,
        "seed": seed,
        "duration_s": duration,
        "worker": {"gpu": GPU, "model": MODEL, "kv_tokens": KV_TOKENS},
        "num_users": NUM_USERS,
        "num_abusive": NUM_ABUSIVE,
        "apps": [a.name for a in APPS],
        "rows": list(rows.values()),
        "claims": checks,
        "all_claims_passed": all(c["passed"] for c in checks),
        "sim_wall_s": round(time.perf_counter() - wall0, 3),
    }


def cli_run(args: Any, cluster_flags: tuple[str, ...], usage_error: type, print_rows) -> int:
    """``python -m sgl_fair.experiment run fairserve-apps [--quick] [--json] [--seed N]``."""
    given = [f"--{f}" for f in cluster_flags if getattr(args, f) is not None]
    if given:
        raise usage_error(f"{', '.join(given)}: only for cluster experiments, not {NAME}")
    data = run(quick=args.quick, seed=args.seed)
    out = args.out or Path("runs") / NAME
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    header = list(TABLE_COLUMNS)
    body = [[_fmt(row[k]) for k in header] for row in data["rows"]]
    print_rows(f"{NAME} ({FIGURE}) — {DESCRIPTION}", header, body)
    for claim in data["claims"]:
        print(f"  [{'PASS' if claim['passed'] else 'FAIL'}] {claim['text']} — {claim['detail']}")
    print(f"results: {out / 'results.json'}")
    return 0


TABLE_COLUMNS = (
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
)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) and abs(v) < 100 else str(v)
