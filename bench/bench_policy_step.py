"""Policy step: the DLPM admission order for 2,000 waiting requests, prefix matching included.

Target (issue #2): <= 2 ms median. SGLang's own LPM falls back to FCFS above 128 waiting
requests because its per-step matching is too slow; we sort all of them every time.

Setup: a worker's radix cache holding 64 system prompts (400 tokens each) and 400 earlier
requests; 2,000 waiting requests from 20 clients, each a system prompt (3/4 of them cached)
plus a 200-token question. Between measured walks the tree changes the way a live worker's
does — one request's prompt is inserted (a prefill finished) and one cached leaf evicted —
so memoized matches are really invalidated where a path changed.

Measured, per walk (median of N):
* ``walk``: what the scheduler does each prefill attempt — order + pull requests while the
  8,192-token prefill budget lasts, charging each (DLPM deficits, replenishing as needed);
* ``full order``: the complete DLPM order of all 2,000 (every request pulled and charged);
* ``cold``: the walk with no memoized matches (every prompt matched from scratch);
* ``rank all``: only the LPM ranking of all 2,000 (matching + sort).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from sgl_fair.policies import make_policy
from sgl_fair.radix import MatchMemo, RadixTree
from sgl_fair.request import Request

NUM_WAITING = 2000
NUM_CLIENTS = 20
SYS_LEN, Q_LEN = 400, 200
BUDGET_TOKENS = 8192


class View:
    """The scheduler's view, with its memoized matching (same code path as Scheduler)."""

    def __init__(self, tree: RadixTree, memoize: bool = True) -> None:
        self.tree = tree
        self.memoize = memoize
        self.memo: dict[Request, MatchMemo] = {}
        self.now = 0.0
        self.running = ()

    def prefix_len(self, req: Request) -> int:
        if not self.memoize:
            return self.tree.match_len(req.input_ids)
        memo = self.memo.get(req)
        fresh = self.tree.memo_match(req.input_ids, memo)
        if fresh is not memo:
            self.memo[req] = fresh
        return fresh.length


def build(seed: int = 0):
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(32000) for _ in range(SYS_LEN)) for _ in range(64)]
    tree = RadixTree()
    for s in systems[:48]:
        tree.insert(s)
    for _ in range(400):
        tree.insert(rng.choice(systems[:48]) + tuple(rng.randrange(32000) for _ in range(Q_LEN)))
    waiting = [
        Request(
            f"r{i}",
            f"client{i % NUM_CLIENTS}",
            rng.choice(systems) + tuple(rng.randrange(32000) for _ in range(Q_LEN)),
            128,
            i * 0.001,
        )
        for i in range(NUM_WAITING)
    ]
    return rng, tree, waiting


def walk(policy, waiting, view, *, budget: int | None) -> int:
    """Pull from the policy's order as the scheduler does; return how many were admitted."""
    gen = policy.order(waiting, view)
    n = 0
    spent = 0
    for req in gen:
        extend = req.input_len - view.prefix_len(req)
        if budget is not None and spent + extend > budget:
            break
        spent += extend
        policy.on_admitted(req, extend)
        n += 1
    gen.close()
    return n


def measure(*, full: bool, memoize: bool, reps: int, seed: int = 0) -> tuple[float, int]:
    rng, tree, waiting = build(seed)
    view = View(tree, memoize=memoize)
    times = []
    admitted = 0
    for rep in range(reps + 1):
        policy = make_policy("dlpm", quantum=2048)
        for r in waiting:
            policy.on_arrival(r, 0.0)
        t0 = time.perf_counter()
        admitted = walk(policy, waiting, view, budget=None if full else BUDGET_TOKENS)
        elapsed = time.perf_counter() - t0
        if rep:  # the first walk fills the memo (like the first step after arrivals)
            times.append(elapsed)
        # The tree changes between steps, as on a live worker.
        tree.insert(rng.choice(waiting).input_ids)
        tree.evict(1)
    return statistics.median(times) * 1e3, admitted


def measure_rank(*, reps: int, seed: int = 0) -> float:
    """Only the LPM ranking of all 2,000 (prefix match + sort), the first half of a walk."""
    from sgl_fair.policies.lpm import lpm_order

    rng, tree, waiting = build(seed)
    view = View(tree)
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        lpm_order(waiting, view)
        if rep:
            times.append(time.perf_counter() - t0)
        tree.insert(rng.choice(waiting).input_ids)
        tree.evict(1)
    return statistics.median(times) * 1e3


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    walk_ms, n_walk = measure(full=False, memoize=True, reps=args.reps)
    full_ms, n_full = measure(full=True, memoize=True, reps=max(args.reps // 4, 10))
    cold_ms, _ = measure(full=False, memoize=False, reps=max(args.reps // 4, 10))
    rank_ms = measure_rank(reps=args.reps)
    result = {
        "bench": "policy_step",
        "num_waiting": NUM_WAITING,
        "walk_median_ms": round(walk_ms, 3),
        "walk_admitted": n_walk,
        "full_order_median_ms": round(full_ms, 3),
        "full_order_admitted": n_full,
        "cold_walk_median_ms": round(cold_ms, 3),
        "rank_all_median_ms": round(rank_ms, 3),
        "target_ms": 2.0,
        "meets_target": walk_ms <= 2.0,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
