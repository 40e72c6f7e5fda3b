"""The plugin's admission pass inside a live SGLang server's loop, beside SGLang's own.

``bench_sglang_adapter.py`` times one admission pass on a rig (SGLang's real method, no server).
This bench times it where it runs: a real ``sglang.launch_server`` on this CPU (tiny random
Llama, ``tests/sglang/live_rig.py``) with ``SGLFAIR_PROFILE_ADMISSION`` set, so each call of the
scheduler's prefill-batch step (``calc_priority``, the ``PrefillAdder`` loop, building the
batch; ``worker/sglang/profile.py``) is timed inside the server's own event loop.

Workload (the rig bench's): N requests from 8 clients, prompts of a shared document (6
documents of 200–2,000 tokens, so prefixes are cached) plus 32 tokens of their own, 16 output
tokens each, all sent at once; ``--max-running-requests 8`` keeps the queue deep while it
drains; KV events on, as the launcher runs its servers (the plugin's shadow cache follows
them). Cases: SGLang's own ``fcfs`` and ``lpm`` (plugin off), the plugin's ``fcfs``, ``vtc``
and ``dlpm``. Reported per case: the median and P90 of the calls that admitted a request,
while ~1,000 (800–1,000) and ~128 (64–192) requests waited; and the plugin's KV-event drains
(its shadow cache, for the policies that ask prefix lengths: ``dlpm``), which run in the
batch-result hook, off the admission step: how many and their median.

``--churn`` (run with ``--requests 2000`` in ``make bench``): half the requests at once, the
other half arriving 20 a second over the drain, and one in ten abandoned by its client after
0.2–3 s — so requests arrive, finish (their KV events reach the plugin's shadow) and are
aborted between passes, as on a serving server; all-at-once has no arrivals after the first.

    .venv/bin/python bench/bench_sglang_live.py [--requests 1000] [--churn] [--cases ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

import live_rig  # noqa: E402

CASES = ("sglang:fcfs", "sglang:lpm", "plugin:fcfs", "plugin:vtc", "plugin:dlpm")
BINS = {"~1000": (800, 1000), "~128": (64, 192)}


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(10, vocab) for _ in range(rng.randint(200, 2000))] for _ in range(6)]
    out = []
    for i in range(n):
        own = [rng.randrange(10, vocab) for _ in range(32)]
        out.append((f"c{i % 8}", rng.choice(docs) + own))
    return out


async def send_all(url: str, reqs: list[tuple[str, list[int]]], churn: bool = False) -> int:
    """Send ``reqs``; how many got a 200. ``churn``: half of them at once, the rest as a steady
    stream over the drain (arrivals between passes, whose prompts' KV events follow), and one
    in ten of all abandoned by its client after 0.2–3 s (aborts in the queue and running)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)  # all N at once (aiohttp's default caps at 100)
    rng = random.Random(1)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def one(i: int, client: str, ids: list[int]) -> int:
            if churn and i >= len(reqs) // 2:
                await asyncio.sleep(0.05 * (i - len(reqs) // 2))  # 20 arrivals a second
            body = {
                "input_ids": ids,
                "routing_key": client,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
            }

            async def call() -> int:
                async with http.post(url + "/generate", json=body) as r:
                    await r.read()
                    return r.status

            if churn and i % 10 == 9:  # the client goes away: SGLang aborts the request
                try:
                    return await asyncio.wait_for(call(), rng.uniform(0.2, 3.0))
                except asyncio.TimeoutError:
                    return 499
            return await call()

        codes = await asyncio.gather(*(one(i, c, ids) for i, (c, ids) in enumerate(reqs)))
    return sum(1 for c in codes if c == 200)


def run_case(case: str, model: Path, n: int, work: Path, churn: bool = False) -> dict:
    kind, policy = case.split(":")
    prof = work / f"prof-{kind}-{policy}"
    extra = {"SGLFAIR_PROFILE_ADMISSION": str(prof)}
    # KV events on, as the launcher starts its servers: the plugin's shadow of SGLang's
    # (unified) radix cache follows them; without them DLPM would match per request per pass
    events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{live_rig.free_port()}",
              "bind": True, "topic": ""}  # fmt: skip
    args = ["--max-running-requests", "8", "--context-length", "4096",
            "--kv-events-config", json.dumps(events)]  # fmt: skip
    if kind == "plugin":
        from sgl_fair.worker.sglang.settings import PluginSettings

        extra |= PluginSettings(policy, {}).env()
    else:
        args += ["--schedule-policy", policy]
    env = live_rig.server_env(extra=extra)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with live_rig.SGLangServer(model, work / f"server-{case}.log", args=args, env=env) as s:
        t0 = time.monotonic()
        ok = asyncio.run(send_all(s.url, workload(n, vocab), churn))
        wall = time.monotonic() - t0
    records = []
    for path in glob.glob(f"{prof}.*"):
        records += [json.loads(line) for line in Path(path).read_text().splitlines()]
    drains = [1e3 * r["s"] for r in records if "drain" in r]  # the shadow's, off the pass
    records = [r for r in records if "admitted" in r]
    row = {"case": case, "requests": n, "churn": churn, "ok": ok, "wall_s": round(wall, 1),
           "calls": len(records)}  # fmt: skip
    row["drain"] = {
        "n": len(drains),
        "p50_ms": round(float(np.median(drains)), 3) if drains else None,
        "total_ms": round(sum(drains), 1),
    }
    for name, (lo, hi) in BINS.items():
        ms = [1e3 * r["s"] for r in records if r["admitted"] > 0 and lo <= r["waiting"] <= hi]
        row[name] = {
            "n": len(ms),
            "p50_ms": round(float(np.median(ms)), 2) if ms else None,
            "p90_ms": round(float(np.percentile(ms, 90)), 2) if ms else None,
        }
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the cases; print a line each (``--json``: the rows at the end); return the rows."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument(
        "--churn",
        action="store_true",
        help="half the requests at once, half as a stream; 1 in 10 abandoned",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-live-"))
    model = live_rig.write_tiny_llama(work / "model")
    rows = []
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        row = run_case(case, model, args.requests, work, args.churn)
        rows.append(row)
        if not args.json:
            cells = "  ".join(
                f"{b}: {row[b]['p50_ms']} / {row[b]['p90_ms']} ms (n={row[b]['n']})" for b in BINS
            )
            drain = row["drain"]
            print(f"{case:<13} ok {row['ok']}/{args.requests}  {cells}  drains: {drain['n']}, "
                  f"p50 {drain['p50_ms']} ms (off the pass)", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
