"""What the SGLang plugin costs SGLang's scheduler: one admission pass, ours vs SGLang's own.

Runs SGLang 0.5.23's real ``Scheduler._get_new_batch_prefill_raw`` on the CPU (the rig of
``tests/sglang/sglang_rig.py``: real ``Req``, ``RadixCache``, ``PrefillAdder``) over N waiting
requests from 8 clients sharing 6 cached documents, and times one pass (calc_priority + the
admission loop) with SGLang's ``fcfs`` and ``lpm`` and with the plugin's ``fcfs``, ``vtc`` and
``dlpm``, under a 4,096-token prefill budget (a pass admits a few dozen). ``first``: the pass
that meets every request (the shadow's first prefix matches); ``next``: the pass after it, over the
requests left (steady state: SGLang's prefix matches have split the cache's nodes by then).
``plugin-exact`` is the plugin with its shadow cache off (``disable_shadow``): SGLang's own
``match_prefix`` per waiting request per pass, as before the shadow (2026-11-25); the bench
checks that both admit the same requests in the same order. ``--waiting 1000 --cases
plugin:dlpm,plugin-exact:dlpm`` runs just the comparison; ``--cache unified`` runs it on
SGLang's ``UnifiedRadixCache`` (the server default), which the plugin follows from its KV events.

Arrivals go through the plugin's arrival hook (``plugin._around_add_request``, what the
installed hook runs around ``Scheduler._add_request_to_queue``), as in a server: SGLang calls
``_add_request_to_queue`` while it receives requests (``ingest_requests``), before
``get_next_batch_to_run``, so the ledger's per-arrival work (the mirror, the policy's
``on_arrival``) is never part of an admission pass. ``arrival`` is that work for all N
requests, timed on its own. ``--arrivals in-pass`` queues them without the hook instead, as
this bench did before 2026-11-25 (session 8): the first pass then also does every arrival.
Needs the sglang CPU environment (``make sglang-cpu``; ``make bench`` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang"))

import cpu_stubs  # noqa: E402

cpu_stubs.install()

from sglang_rig import Rig, make_req  # noqa: E402

from sgl_fair.worker.sglang import plugin  # noqa: E402
from sgl_fair.worker.sglang.settings import PluginSettings  # noqa: E402

BIG = 1 << 22  # KV pool (tokens): never the limit here
CASES = [("sglang", "fcfs"), ("sglang", "lpm"), ("plugin", "fcfs"), ("plugin", "vtc"),
         ("plugin", "dlpm"), ("plugin-exact", "dlpm")]  # fmt: skip


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 30000) for _ in range(rng.randint(200, 2000))] for _ in range(6)]
    reqs = []
    for _ in range(n):
        doc = rng.choice(docs)
        tail = [rng.randrange(30000, 32000) for _ in range(rng.randint(20, 200))]
        reqs.append((f"c{rng.randrange(8)}", doc[: rng.randint(50, len(doc))] + tail))
    return docs, reqs


def _append(scheduler, req, *args, **kwargs) -> None:
    scheduler.waiting_queue.append(req)  # what SGLang's _add_request_to_queue does with it


def two_passes(
    kind: str, policy: str, n: int, budget: int, hooked: bool = True, cache: str = "radix"
) -> tuple[float, float, float, list[list[int]]]:
    docs, reqs = workload(n)
    rig = Rig(policy=policy if kind == "sglang" else "fcfs", kv_tokens=BIG,
              max_prefill_tokens=budget, chunked_prefill_size=budget, cache=cache)  # fmt: skip
    if kind != "sglang":
        fair = plugin.install_policy(rig.scheduler, PluginSettings(policy, {}))
        if kind == "plugin-exact":
            fair.disable_shadow()
            fair.exact_cap = None  # the shadow's oracle: every request matched, as before
    for doc in docs:
        rig.cache(doc)
    queued = [make_req(ids, client) for client, ids in reqs]
    arrive = plugin._around_add_request if kind != "sglang" and hooked else None
    ta = time.perf_counter()
    for req in queued:
        if arrive is None:
            rig.queue(req)
        else:
            arrive(_append, rig.scheduler, req)
    t0 = time.perf_counter()
    assert arrive is None or len(fair.ledger) == n  # every arrival is in the ledger already
    admitted = rig.admit()
    t1 = time.perf_counter()
    admitted_next = rig.admit()
    t2 = time.perf_counter()
    pos = {id(r): i for i, r in enumerate(queued)}  # rids differ per run: positions do not
    order = [[pos[id(r)] for r in a] for a in (admitted, admitted_next)]
    return t0 - ta, t1 - t0, t2 - t1, order


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waiting", default="128,1000", help="queue depths, comma-separated")
    ap.add_argument("--cases", default=",".join(f"{k}:{p}" for k, p in CASES),
                    help="kind:policy,... (kinds: sglang, plugin, plugin-exact)")  # fmt: skip
    ap.add_argument("--arrivals", choices=("hook", "in-pass"), default="hook",
                    help="plugin arrivals through its hook, timed apart (a server), or left "
                    "to the first pass (no hook)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3, help="runs per case (medians reported)")
    ap.add_argument("--cache", choices=("radix", "unified"), default="radix",
                    help="SGLang's RadixCache, or its UnifiedRadixCache (0.5.23's server "
                    "default; Python tree core, KV events on: the event shadow)")  # fmt: skip
    args = ap.parse_args(argv)
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin._settings = None
    os.environ.update(PluginSettings("fcfs", {}).env())
    plugin.register()
    HookRegistry.apply_hooks()
    rows = []
    for n in (int(x) for x in args.waiting.split(",")):
        orders = {}
        for kind, policy in cases:
            hooked = args.arrivals == "hook"
            runs = [two_passes(kind, policy, n, 4096, hooked, args.cache) for _ in range(args.runs)]
            arrival, first, nxt = (statistics.median(r[i] for r in runs) * 1e3 for i in range(3))
            orders[kind, policy] = runs[0][3]
            rows.append({"waiting": n, "scheduler": kind, "policy": policy, "cache": args.cache,
                         "arrivals": args.arrivals, "arrival_ms": round(arrival, 1),
                         "first_pass_ms": round(first, 1), "next_pass_ms": round(nxt, 1),
                         "admitted": len(runs[0][3][0])})  # fmt: skip
            print(f"{n:5d} {kind:12s} {policy:5s} arrival {arrival:7.1f} ms  first {first:8.1f} "
                  f"ms  next {nxt:8.1f} ms  admitted {len(runs[0][3][0])}", flush=True)  # fmt: skip
        for (kind, policy), order in orders.items():
            exact = orders.get(("plugin-exact", policy))
            if kind == "plugin" and exact is not None and order != exact:
                raise SystemExit(f"{policy} at {n} waiting: shadow and exact orders differ")
    return {"adapter_pass": rows}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
