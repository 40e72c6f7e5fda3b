"""``make demo-bros``: real-time chat stays fast while a best-effort batch job runs (BROS).

One simulated worker (8 × A100-80GB serving Llama-3-70B with TP 8, in real time) behind the
live server, run twice — ``--schedule-policy fcfs`` (what a plain server does) and ``bros`` —
with the same traffic over HTTP:

* **RT chat** (``"priority_class": "rt"``): streaming requests, Poisson at ``--rt-rate``/s,
  prompts of 200 tokens, 64 output tokens, for the whole run;
* **BE batch job** (``"priority_class": "be"``): after ``--calm`` seconds, closed-loop batches of
  32 requests of 768 prompt tokens / 64 output tokens, the next batch when the last is done.

Prompts are sent as ``input_ids``, so they are exactly that long.

It prints RT time-to-first-token and time-per-output-token (P50/P99) before and during the
batch job, the share of RT requests meeting the SLOs (TTFT 0.4 s, TPOT 0.2 s), and the batch
job's output tokens/s. About ``2 × (calm + busy)`` seconds plus start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sgl_fair.demo.server import serving
from sgl_fair.metrics import percentiles

GPU, MODEL, TP = "A100-80GB", "Llama-3-70B", "8"
TTFT_SLO_S, TPOT_SLO_S = 0.4, 0.2
BE_BATCH = 32
RT_PROMPT, BE_PROMPT = 200, 768  # prompt tokens


def prompt_ids(i: int, n: int) -> list[int]:
    """``n`` token ids unique to request ``i``: prompts sent as ``input_ids`` have exactly the
    lengths the demo states (text would be as long as the tokenizer makes it; the built-in
    one spells a word it does not know in bytes) and share no prefix. Seeded by a string:
    ``random.Random(-1)`` is ``random.Random(1)`` (an int seed loses its sign)."""
    rng = random.Random(f"prompt/{i}")
    return [rng.randrange(1_000, 30_000) for _ in range(n)]


async def rt_call(http, url: str, i: int, out: list[dict], phase: str) -> None:
    body = {
        "input_ids": prompt_ids(i, RT_PROMPT),
        "stream": True,
        "priority_class": "rt",
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    prompt_tokens = None
    async with http.post(url + "/generate", json=body) as r:
        if r.status != 200:
            out.append({"phase": phase, "error": r.status})
            return
        async for line in r.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            meta = json.loads(line[5:])["meta_info"]
            stamps.append((time.perf_counter() - t0, meta["completion_tokens"]))
            prompt_tokens = meta["prompt_tokens"]
    if not stamps:
        out.append({"phase": phase, "error": "no tokens"})
        return
    ttft = stamps[0][0]
    (t_end, n_end) = stamps[-1]
    tpot = (t_end - ttft) / max(n_end - stamps[0][1], 1)
    out.append({"phase": phase, "ttft": ttft, "tpot": tpot, "prompt_tokens": prompt_tokens})


async def be_job(http, url: str, stop: asyncio.Event, done_tokens: list[int]) -> None:
    k = 0
    while not stop.is_set():

        async def one(i: int) -> None:
            body = {
                "input_ids": prompt_ids(-1 - i, BE_PROMPT),
                "priority_class": "be",
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
            }
            async with http.post(url + "/generate", json=body) as r:
                if r.status == 200:
                    done_tokens[0] += (await r.json())["meta_info"]["completion_tokens"]

        await asyncio.gather(*(one(k + j) for j in range(BE_BATCH)))
        k += BE_BATCH


async def drive(url: str, rate: float, calm_s: float, busy_s: float, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    rows: list[dict] = []
    done = [0]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        tasks: list[asyncio.Task] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        job: asyncio.Task | None = None
        be_start = be_end = 0.0
        i = 0
        while (now := time.perf_counter() - t0) < calm_s + busy_s:
            if job is None and now >= calm_s:
                be_start = time.perf_counter()
                job = asyncio.create_task(be_job(http, url, stop, done))
            phase = "calm" if job is None else "busy"
            tasks.append(asyncio.create_task(rt_call(http, url, i, rows, phase)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        stop.set()
        await asyncio.gather(*tasks)
        be_end = time.perf_counter()
        if job is not None:
            job.cancel()
    be_tok_s = done[0] / max(be_end - be_start, 1e-9)
    return {"rows": rows, "be_tok_s": be_tok_s}


def summarize(result: dict) -> dict[str, dict]:
    out = {}
    for phase in ("calm", "busy"):
        ok = [r for r in result["rows"] if r["phase"] == phase and "ttft" in r]
        errors = sum(1 for r in result["rows"] if r["phase"] == phase and "error" in r)
        if not ok:
            out[phase] = {"requests": 0, "errors": errors}
            continue
        ttft, tpot = percentiles([r["ttft"] for r in ok]), percentiles([r["tpot"] for r in ok])
        out[phase] = {
            "requests": len(ok),
            "errors": errors,
            "ttft_p50": ttft[50],
            "ttft_p99": ttft[99],
            "tpot_p50": tpot[50],
            "tpot_p99": tpot[99],
            "slo_met": sum(r["ttft"] <= TTFT_SLO_S and r["tpot"] <= TPOT_SLO_S for r in ok)
            / len(ok),
        }
    return out


def run_policy(policy: str, args: argparse.Namespace, work: Path) -> dict:
    log_path = work / f"server-{policy}.log"
    args_ = ["--dp", "1", "--gpu", GPU, "--model", MODEL, "--tp", TP, "--schedule-policy", policy]
    with serving(args_, log_path) as url:
        result = asyncio.run(drive(url, args.rt_rate, args.calm, args.busy, args.seed))
    return {"summary": summarize(result), "be_tok_s": result["be_tok_s"]}


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:,.0f} ms"


def print_table(results: dict[str, dict]) -> None:
    head = ("policy", "phase", "RT reqs", "TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99",
            "SLOs met", "BE tok/s")  # fmt: skip
    print(" | ".join(head))
    for policy, res in results.items():
        for phase, s in res["summary"].items():
            if not s.get("requests"):
                print(f"{policy} | {phase} | 0 | - | - | - | - | - | -")
                continue
            be = f"{res['be_tok_s']:,.0f}" if phase == "busy" else "-"
            print(
                f"{policy} | {phase} | {s['requests']} | {_fmt_ms(s['ttft_p50'])} | "
                f"{_fmt_ms(s['ttft_p99'])} | {_fmt_ms(s['tpot_p50'])} | "
                f"{_fmt_ms(s['tpot_p99'])} | {100 * s['slo_met']:.0f} % | {be}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sgl_fair.demo bros", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rt-rate", type=float, default=6.0, help="RT chat requests per second")
    p.add_argument("--calm", type=float, default=10.0, help="seconds of RT chat alone")
    p.add_argument("--busy", type=float, default=30.0, help="seconds with the BE batch job")
    p.add_argument("--policies", default="fcfs,bros")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rt_rate <= 0 or args.calm < 0 or args.busy <= 0:
        p.error("--rt-rate and --busy must be > 0, --calm >= 0")
    work = Path(tempfile.mkdtemp(prefix="sgl-fair-demo-bros-"))
    results = {}
    for policy in args.policies.split(","):
        print(f"{policy}: {args.calm:.0f} s of RT chat, then {args.busy:.0f} s with a BE batch job",
              flush=True)  # fmt: skip
        results[policy] = run_policy(policy, args, work)
    print_table(results)
    print(f"server logs: {work}")
    return 0
