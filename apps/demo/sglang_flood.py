"""``python -m sgl_fair.demo sglang`` (``make demo-sglang``): the fairness demo on real SGLang.

For each policy (``fcfs`` = SGLang's own order through the plugin, then ``vtc`` and ``dlpm``)
it starts ``python -m sgl_fair.launch --backend sglang --dp 1 --model-path M`` — a real
``sglang.launch_server`` with our plugin deciding its admission — and drives it for
``--duration`` seconds with two tenants over HTTP:

- ``flood`` keeps ``--flood-inflight`` long requests in flight (closed loop): it asks for far
  more than the server can serve;
- ``victim`` keeps one short request in flight, as a well-behaved interactive user.

SGLang runs ``--max-running-requests`` at once, so its waiting queue decides who runs next.
The table: per tenant, requests offered (sent) and served, output tokens, share of service,
TTFT P50/P99 (streamed). Under ``fcfs`` the victim's request waits behind the flood's backlog;
under ``vtc``/``dlpm`` it is admitted next, so its TTFT falls to about one decode step's
wait. On this CPU the model is a tiny random Llama (``make demo-sglang`` writes it and puts
the CPU test shim on the servers' path; see the README); on a GPU pass a real model and drop
``--cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sgl_fair.demo.server import serving

CPU_FLAGS = ("--device", "cpu", "--max-total-tokens", "20000", "--skip-server-warmup")
POLICIES = ("fcfs", "vtc", "dlpm")
# DLPM's quantum is in tokens of service: its default (2,048) suits prompts of thousands of
# tokens; here a flood request costs ~140 (12 prompt + 2 x 64 output), so 2,048 would let the
# flood run ~14 requests per round before the victim's turn. 256 is about two of them.
POLICY_OPTS = {"dlpm": ("--schedule-policy-opt", "quantum=256")}


@dataclass
class Tenant:
    name: str
    inflight: int
    max_new_tokens: int
    sent: int = 0
    served: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)


async def _one(http, url: str, t: Tenant, i: int) -> None:
    import aiohttp

    body = {
        "text": f"{t.name} request {i}: tell me a long story about fairness",
        "sampling_params": {"max_new_tokens": t.max_new_tokens, "ignore_eos": True},
        "stream": True,
    }
    t.sent += 1
    start = time.monotonic()
    first = None
    last = None
    try:
        async with http.post(url + "/generate", json=body, headers={"X-Client-Id": t.name}) as r:
            if r.status != 200:
                t.failed += 1
                return
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                first = first if first is not None else time.monotonic() - start
                last = json.loads(line[5:])
    except (aiohttp.ClientError, asyncio.TimeoutError):
        t.failed += 1
        return
    if last is None or first is None:
        t.failed += 1
        return
    t.served += 1
    t.ttfts.append(first)
    t.prompt_tokens += int(last["meta_info"].get("prompt_tokens", 0))
    t.output_tokens += int(last["meta_info"].get("completion_tokens", 0))


async def drive(url: str, tenants: Sequence[Tenant], duration_s: float) -> None:
    """Each tenant keeps ``inflight`` requests going until ``duration_s`` has passed; the
    requests in flight then finish (counted as served when they do)."""
    import aiohttp

    deadline = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def loop(t: Tenant, lane: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                await _one(http, url, t, lane * 100_000 + i)
                i += 1

        await asyncio.gather(*(loop(t, k) for t in tenants for k in range(t.inflight)))


def table(policy: str, tenants: Sequence[Tenant]) -> list[str]:
    service = {t.name: t.prompt_tokens + 2 * t.output_tokens for t in tenants}
    total = sum(service.values()) or 1
    lines = [
        f"{policy}:",
        f"  {'tenant':<8} {'sent':>5} {'served':>6} {'failed':>6} {'out tok':>8} "
        f"{'share':>6} {'TTFT P50':>9} {'TTFT P99':>9}",
    ]
    for t in tenants:
        p50, p99 = np.percentile(t.ttfts, [50, 99]) if t.ttfts else (float("nan"),) * 2
        lines.append(
            f"  {t.name:<8} {t.sent:>5} {t.served:>6} {t.failed:>6} {t.output_tokens:>8} "
            f"{service[t.name] / total:>6.1%} {p50:>8.2f}s {p99:>8.2f}s"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sgl_fair.demo sglang", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--flood-inflight", type=int, default=12)
    p.add_argument("--max-running-requests", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="run the servers on the CPU (tiny model)")
    p.add_argument("--out", default="runs/demo-sglang")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if args.duration <= 0 or args.flood_inflight < 1 or args.max_running_requests < 1:
        p.error("--duration must be > 0, --flood-inflight and --max-running-requests >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    for policy in policies:
        launch = [
            "--backend", "sglang", "--dp", "1", "--model-path", args.model_path,
            "--schedule-policy", policy, *POLICY_OPTS.get(policy, ()),
            "--max-running-requests", str(args.max_running_requests),
            *(CPU_FLAGS if args.cpu else ()),
        ]  # fmt: skip
        print("$ python -m sgl_fair.launch " + " ".join(launch), flush=True)
        tenants = [Tenant("flood", args.flood_inflight, 64), Tenant("victim", 1, 8)]
        log = out / f"server-{policy}.log"
        with serving(launch, log, timeout_s=600) as url:
            print(f"  ready at {url}; driving for {args.duration:.0f} s", flush=True)
            asyncio.run(drive(url, tenants, args.duration))
        lines = table(policy, tenants)
        print("\n".join(lines), flush=True)
        report += lines
    with contextlib.suppress(OSError):
        (out / "report.txt").write_text("\n".join(report) + "\n")
    print(f"report: {out / 'report.txt'}")
    return 0
