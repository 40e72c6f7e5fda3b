"""What the SGLang plugin costs SGLang's scheduler: one admission pass, ours vs SGLang's own.

Runs SGLang 0.5.23's real ``Scheduler._get_new_batch_prefill_raw`` on the CPU (the rig of
``tests/sglang/sglang_rig.py``: real ``Req``, ``RadixCache``, ``PrefillAdder``) over N waiting
requests from 8 clients sharing 6 cached documents, and times one pass (calc_priority + the
admission loop) with SGLang's ``fcfs`` and ``lpm`` and with the plugin's ``fcfs``, ``vtc`` and
``dlpm``, under a 4,096-token prefill budget (a pass admits a few dozen). ``first``: the pass
that meets every request (the plugin builds its mirrors); ``next``: the pass after it, over the
requests left (steady state: SGLang's prefix matches have split the cache's nodes by then).
Needs the sglang CPU environment (``make sglang-cpu``; ``make bench`` builds it).
"""

from __future__ import annotations

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
         ("plugin", "dlpm")]  # fmt: skip


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 30000) for _ in range(rng.randint(200, 2000))] for _ in range(6)]
    reqs = []
    for _ in range(n):
        doc = rng.choice(docs)
        tail = [rng.randrange(30000, 32000) for _ in range(rng.randint(20, 200))]
        reqs.append((f"c{rng.randrange(8)}", doc[: rng.randint(50, len(doc))] + tail))
    return docs, reqs


def two_passes(kind: str, policy: str, n: int, budget: int) -> tuple[float, float, int]:
    docs, reqs = workload(n)
    rig = Rig(policy=policy if kind == "sglang" else "fcfs", kv_tokens=BIG,
              max_prefill_tokens=budget, chunked_prefill_size=budget)  # fmt: skip
    if kind == "plugin":
        plugin.install_policy(rig.scheduler, PluginSettings(policy, {}))
    for doc in docs:
        rig.cache(doc)
    for client, ids in reqs:
        rig.queue(make_req(ids, client))
    t0 = time.perf_counter()
    admitted = rig.admit()
    t1 = time.perf_counter()
    rig.admit()
    return t1 - t0, time.perf_counter() - t1, len(admitted)


def main() -> dict:
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin._settings = None
    os.environ.update(PluginSettings("fcfs", {}).env())
    plugin.register()
    HookRegistry.apply_hooks()
    rows = []
    for n in (128, 1000):
        for kind, policy in CASES:
            runs = [two_passes(kind, policy, n, 4096) for _ in range(3)]
            first = statistics.median(r[0] for r in runs) * 1e3
            nxt = statistics.median(r[1] for r in runs) * 1e3
            rows.append({"waiting": n, "scheduler": kind, "policy": policy,
                         "first_pass_ms": round(first, 1), "next_pass_ms": round(nxt, 1),
                         "admitted": runs[0][2]})  # fmt: skip
            print(f"{n:5d} {kind:7s} {policy:5s} first {first:8.1f} ms  next {nxt:8.1f} ms  "
                  f"admitted {runs[0][2]}", flush=True)  # fmt: skip
    return {"adapter_pass": rows}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
