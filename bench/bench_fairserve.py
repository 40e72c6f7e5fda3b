"""FairServe's per-request cost at 10,000 users: arrival (lift + OIT), selection, finish.

Target (issue 14): <= 50 µs per request at 10,000 users, with a deep waiting queue.

Setup: 10,000 users of two apps — ``chat`` (interactions of 1-3 calls, one at a time) and
``agent`` (3-6 calls; half of its interactions start with a fan-out of 2-3 calls that wait
together, like a ToT step) — on the real ``Scheduler`` over a real radix cache (4M-token
pool, so memory never blocks; 8,192-token prefill budget, 512 running slots). The waiting
queue is kept at ``depth`` (20,000, then 2,000): between passes, a finished call's next call
arrives (a *continuing* call, served first by FairServe) and new interactions from random
users top the queue back up (*starting* calls, checked by OIT: the worker is overloaded).
Prompts are 64-320 tokens (a 32-token app system prompt + a unique tail), outputs 1-4
tokens, so every decode step finishes calls and every prefill pass admits ≈ 40.

Measured, medians over the measured passes (after a warm-up):

* ``arrival_us``: ``on_arrival`` per request (the counter lift and OIT's windows);
* ``select_us``: the policy's share of one admission pass — pulling its ``order`` walk plus
  ``on_admitted`` (the charge) — divided by the requests the pass admitted;
  ``select_mean_us`` is the total over all measured passes divided by all they admitted
  (passes cut short by the 512 running slots admit a few requests, so they weigh less);
* ``finish_us``: ``on_finished`` per request (settlement + learning);
* ``pass_us``: the whole ``Scheduler.step`` of a prefill pass per admitted request, for
  context: it includes the scheduler's own O(waiting) queue copies, not the policy's.

``--check`` runs each depth twice more, once with the policy's reference path (the
straightforward per-pass rebuild, ``FairServe.incremental = False``) and compares the
admission order pass by pass; ``--record``/``--compare`` store or compare admission orders
across code versions (the same workload is replayed exactly: it is seeded and in virtual time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker.builder import build_worker, register_engine
from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.loop import SimLoop

NUM_USERS = 10_000
DEPTHS = (20_000, 2_000)
BUDGET_TOKENS = 8192
SYS_LEN = 32
TARGET_US = 50.0
OUTPUT_BASE = 1 << 30
POOL_TOKENS = 4_000_000  # memory never blocks
ENGINE = "bench-fairserve-pass"  # this bench's engine in the worker builder's registry


@dataclass
class Costs:
    """Seconds spent in the policy's hooks, and per-pass samples."""

    arrival: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    select: list[float] = field(default_factory=list)  # per pass, per admitted request
    select_total: float = 0.0  # over the measured passes
    step: list[float] = field(default_factory=list)  # per pass, per admitted request
    admitted: list[int] = field(default_factory=list)
    pass_select: float = 0.0
    measuring: bool = False


def instrument(policy, costs: Costs) -> None:
    """Time the policy's hooks in place (the scheduler calls them through the instance)."""
    order, admitted = policy.order, policy.on_admitted
    arrival, finished = policy.on_arrival, policy.on_finished
    clock = time.perf_counter

    def timed_order(waiting, view) -> Iterator[Request]:
        t = clock()
        gen = order(waiting, view)
        spent = clock() - t
        try:
            while True:
                t = clock()
                try:
                    req = next(gen)
                except StopIteration:
                    spent += clock() - t
                    return
                spent += clock() - t
                yield req
        finally:
            t = clock()
            gen.close()
            costs.pass_select += spent + clock() - t

    def timed_admitted(req, extend_len) -> None:
        t = clock()
        admitted(req, extend_len)
        costs.pass_select += clock() - t

    def timed_arrival(req, now):
        t = clock()
        out = arrival(req, now)
        if costs.measuring:
            costs.arrival.append(clock() - t)
        return out

    def timed_finished(req) -> None:
        t = clock()
        finished(req)
        if costs.measuring:
            costs.finish.append(clock() - t)

    policy.order, policy.on_admitted = timed_order, timed_admitted
    policy.on_arrival, policy.on_finished = timed_arrival, timed_finished


class Workload:
    """Closed-loop interactions of 10,000 users, seeded; requests in virtual time."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_token = 1 << 20
        self.num_rids = 0
        self.num_interactions = 0
        # interaction id -> (user, app, calls left after the ones issued, next stage)
        self.left: dict[str, tuple[str, str, int, int]] = {}
        self.systems = {
            app: tuple(range(i * SYS_LEN, (i + 1) * SYS_LEN))
            for i, app in enumerate(("chat", "agent"))
        }

    def _call(self, user: str, app: str, iid: str, stage: int, now: float) -> Request:
        n = self.rng.randrange(32, 289)
        tail = tuple(range(self.next_token, self.next_token + n))
        self.next_token += n
        self.num_rids += 1
        return Request(
            f"r{self.num_rids}",
            user,
            self.systems[app] + tail,
            self.rng.randrange(1, 5),
            now,
            app=app,
            stage=stage,
            interaction_id=iid,
        )

    def start(self, now: float) -> list[Request]:
        """A new interaction of a random user: its first call(s)."""
        rng = self.rng
        user = f"u{rng.randrange(NUM_USERS)}"
        app = "agent" if rng.random() < 0.4 else "chat"
        calls = rng.randrange(3, 7) if app == "agent" else rng.randrange(1, 4)
        fan = rng.randrange(2, 4) if app == "agent" and rng.random() < 0.5 else 1
        self.num_interactions += 1
        iid = f"i{self.num_interactions}"
        first = [self._call(user, app, iid, 0, now) for _ in range(fan)]
        if calls > fan:
            self.left[iid] = (user, app, calls - fan, 1)
        return first

    def next_call(self, req: Request, now: float) -> Request | None:
        """The interaction's next call once ``req`` finished (None: it has ended)."""
        iid = req.interaction_id
        if iid is None or iid not in self.left:
            return None
        user, app, n, stage = self.left.pop(iid)
        if n > 1:
            self.left[iid] = (user, app, n - 1, stage + 1)
        return self._call(user, app, iid, stage, now)


class PassEngine:
    """No model: each sampled token is the next number of a counter; a prefill pass takes
    30 ms of virtual time, a decode step 10 ms. It records each prefill pass — the admission
    order, and once past the warm-up the policy's and the scheduler's time per admitted
    request — before the scheduler applies it (``costs.measuring`` then also covers the
    pass's finishes)."""

    def __init__(self, costs: Costs, warmup: int) -> None:
        self.costs = costs
        self.warmup = warmup
        self.token = OUTPUT_BASE
        self.num_passes = 0
        self.orders: list[list[str]] = []
        self.loop: SimLoop | None = None  # whose last step this engine runs

    def run(self, batch: Batch) -> StepResult:
        costs = self.costs
        if batch.prefill:
            self.num_passes += 1
            costs.measuring = self.num_passes > self.warmup
            admitted = [c.req for c in batch.prefill]
            self.orders.append([r.rid for r in admitted])
            if costs.measuring:
                assert self.loop is not None
                n = len(admitted)
                costs.admitted.append(n)
                costs.select.append(costs.pass_select / n)
                costs.select_total += costs.pass_select
                costs.step.append(self.loop.last_step_wall_s / n)
        tokens = []
        for _ in batch.sampling_requests():
            self.token += 1
            tokens.append(self.token)
        return StepResult(batch, 0.03 if batch.prefill else 0.01, tokens)


class PassEngineKind:
    """``PassEngine`` in the worker builder's registry (this bench's own engine)."""

    @dataclass(frozen=True)
    class Config:
        costs: Costs | None = None
        warmup: int = 0

    exact_kv = False
    synchronous = False

    def default_cost_model(self) -> CostModel:
        return CostModel.from_names("H100-80GB", "Llama-3.1-8B")  # unused: FairServe orders

    def default_kv_tokens(self, cost_model: CostModel) -> int:
        return POOL_TOKENS

    def make_engine(self, config, scheduler, allocator, cost_model) -> PassEngine:
        return PassEngine(config.costs or Costs(), config.warmup)

    def live_parts(self, cfg):
        raise ValueError("the bench's pass engine is not for live workers")

    def describe(self, cfg) -> str:
        return "bench pass engine"


register_engine(ENGINE, PassEngineKind())


class TopUp:
    """The arrival source: new interactions top the waiting queue up to ``depth`` (their
    first calls arrive now); a finished call's next call is added by the loop's hook."""

    def __init__(self, wl: Workload, depth: int) -> None:
        self.wl = wl
        self.depth = depth

    def release(self, now: float, scheduler: Scheduler) -> None:
        while scheduler.num_waiting < self.depth:
            for req in self.wl.start(now):
                scheduler.add_request(req, now)

    def next_s(self) -> float | None:
        return None


def run(
    depth: int,
    *,
    passes: int,
    warmup: int,
    seed: int = 0,
    incremental: bool = True,
    policy_name: str = "fairserve",
) -> tuple[Costs, list[list[str]], dict]:
    policy = make_policy(policy_name)
    if hasattr(policy, "incremental"):
        policy.incremental = incremental
    elif not incremental:
        raise SystemExit("this FairServe has no reference path (FairServe.incremental)")
    costs = Costs()
    instrument(policy, costs)
    sched, engine = build_worker(
        policy=policy,
        engine=ENGINE,
        engine_opts={"costs": costs, "warmup": warmup},
        config=SchedulerConfig(max_running_requests=512, chunked_prefill_size=BUDGET_TOKENS),
    )
    assert isinstance(engine, PassEngine)
    wl = Workload(seed)
    done_seen = 0

    def before_step(loop: SimLoop) -> bool:
        costs.pass_select = 0.0
        return engine.num_passes < warmup + passes

    def on_step(loop: SimLoop, batch, result, start_s: float) -> None:
        # Between passes: finished calls' next calls arrive (then new interactions top up).
        nonlocal done_seen
        done = sched.log.done
        for req in done[done_seen:]:
            nxt = wl.next_call(req, loop.now) if req.finish_s is not None else None
            if nxt is not None:
                sched.add_request(nxt, loop.now)
        done_seen = len(done)

    loop = SimLoop(sched, engine, TopUp(wl, depth), before_step=before_step, on_step=on_step)
    engine.loop = loop
    loop.run()
    orders = engine.orders
    info = {
        "throttled": getattr(policy, "num_throttled", 0),
        "fallbacks": getattr(policy, "num_fallbacks", 0),
        "counters_sha1": hashlib.sha1(
            json.dumps(sorted(policy.counters.items())).encode()
        ).hexdigest()[:12],
    }
    if hasattr(policy, "check_invariants"):
        policy.check_invariants()
    return costs, orders, info


def us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 2) if xs else float("nan")


def measure(depth: int, passes: int, warmup: int, seed: int) -> tuple[dict, list[list[str]]]:
    costs, orders, info = run(depth, passes=passes, warmup=warmup, seed=seed)
    select = us(costs.select)
    arrival = us(costs.arrival)
    result = {
        "depth": depth,
        "passes": len(costs.select),
        "admitted_per_pass": statistics.median(costs.admitted) if costs.admitted else 0,
        "arrival_us": arrival,
        "select_us": select,
        "select_mean_us": round(costs.select_total / max(sum(costs.admitted), 1) * 1e6, 2),
        "select_p90_us": round(statistics.quantiles(costs.select, n=10)[-1] * 1e6, 2),
        "finish_us": us(costs.finish),
        "pass_us": us(costs.step),
        **info,
        "meets_target": max(select, arrival) <= TARGET_US,
    }
    return result, orders


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--depth", type=int, action="append", help="waiting queue depth(s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare with the reference path")
    ap.add_argument("--record", help="write the admission orders to this JSON file")
    ap.add_argument("--compare", help="compare the admission orders with this JSON file")
    ap.add_argument("--json", help="also write the result to this file")
    args = ap.parse_args(argv)
    depths = args.depth or list(DEPTHS)
    results, recorded = [], {}
    for depth in depths:
        res, orders = measure(depth, args.passes, args.warmup, args.seed)
        recorded[str(depth)] = {"orders": orders, "counters_sha1": res["counters_sha1"]}
        if args.check:
            _, ref, ref_info = run(
                depth, passes=args.passes, warmup=args.warmup, seed=args.seed, incremental=False
            )
            res["same_order_as_reference"] = ref == orders
            res["same_counters_as_reference"] = ref_info["counters_sha1"] == res["counters_sha1"]
        results.append(res)
    if args.record:
        with open(args.record, "w") as f:
            json.dump(recorded, f)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        for res in results:
            theirs = old.get(str(res["depth"]), {})
            res["same_order_as_recorded"] = (
                theirs.get("orders") == recorded[str(res["depth"])]["orders"]
            )
            res["same_counters_as_recorded"] = theirs.get("counters_sha1") == res["counters_sha1"]
    result = {
        "bench": "fairserve",
        "num_users": NUM_USERS,
        "budget_tokens": BUDGET_TOKENS,
        "target_us": TARGET_US,
        "depths": results,
        "meets_target": all(r["meets_target"] for r in results),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
