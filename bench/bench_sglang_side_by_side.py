"""Our stack beside SGLang's own, on the same servers and the same load (issue 39, item 2).

(a) SGLang's stack: two ``sglang.launch_server`` + SGLang's Rust gateway
(``sglang_router.launch_router --policy cache_aware``); (b) ours:
``python -m sgl_fair.launch --backend sglang --dp 2 --schedule-policy vtc`` (router, one bridge
per server, the plugin in each server). Same tiny random Llama (``tests/sglang/live_rig.py``),
same server flags (``--max-running-requests R``, the CPU flags), same client load: a flood
tenant keeping F streams in flight and a victim keeping 1, for T seconds; every prompt is its
tenant's shared prefix plus a few tokens of its own (prefix-heavy); streaming ``/generate``
with ``input_ids``. Tenants are named by ``Authorization: Bearer sk-<tenant>`` (our tenants
file's keys; SGLang's servers ignore it, its gateway passes it on).

Reported per stack: tokens served (by calls finished within T), each tenant's TTFT P50/P90/P99,
its three slowest first tokens (when, and the stack's own end-to-end time for them) and
served tokens, offered vs served calls, the CPU-seconds over the load window of each
process group (SGLang servers with their scheduler/detokenizer children; the gateway; our
router; our bridges) read with psutil, tokens per server-CPU-second, and the relay's CPU
(gateway, or router + bridges) per streamed token, also less its fixed cost (each group's
CPU per second over ``--idle`` seconds without load, just before); then ours / SGLang's.
Before all that, each stack serves ``--warmup`` calls of each tenant at once, not counted
(default 4; 0 before ``side-by-side-2026-11-29l``, whose victim's P99 was its first call,
made as the servers ran their first batch).

    .venv/bin/python bench/bench_sglang_side_by_side.py [--duration 30] [--flood 24]
        [--max-running 2] [--stacks sglang,ours] [--json runs/side.json]
        [--results bench/results/side-by-side-DATE.json]

``--stacks sglang,ours@REV,ours`` adds our stack as it was at git revision REV (its code first
on the launcher's ``PYTHONPATH``, from ``git archive`` into a temp dir): before/after in one run;
``ours+process`` runs ours with a bridge process per server (``--bridges process``) instead of
the bridges inside the router (the default).

Runs vary (±15 % on a shared 2-core machine): compare the ratios of one run, and repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

import live_rig  # noqa: E402

TENANTS = ("flood", "victim")


# ---- the load -------------------------------------------------------------------------------


def prompts(vocab: int, prefix_len: int, own_len: int, seed: int = 0) -> dict[str, Any]:
    """Per tenant: a function giving the i-th prompt (shared prefix + own tokens)."""
    rng = random.Random(seed)
    prefixes = {t: [rng.randrange(10, vocab) for _ in range(prefix_len)] for t in TENANTS}

    def make(tenant: str, i: int) -> list[int]:
        r = random.Random(f"{tenant}-{i}")
        return prefixes[tenant] + [r.randrange(10, vocab) for _ in range(own_len)]

    return {"make": make}


async def drive(url: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Keep ``flood`` streams of the flood tenant and one of the victim in flight for
    ``duration`` seconds; what each tenant got."""
    import aiohttp

    make = prompts(vocab, args.prefix_len, args.own_len)["make"]
    stats = {t: {"offered": 0, "served": 0, "failed": 0, "tokens": 0, "ttft": [], "calls": []}
             for t in TENANTS}  # fmt: skip
    deadline = time.monotonic() + args.duration
    timeout = aiohttp.ClientTimeout(total=args.duration + 120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def one(tenant: str, i: int) -> None:
            st = stats[tenant]
            st["offered"] += 1
            body = {
                "input_ids": make(tenant, i),
                "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True},
                "stream": True,
            }
            headers = {"Authorization": f"Bearer sk-{tenant}"}
            t0 = time.monotonic()
            first = None
            last = b""
            try:
                async with http.post(url + "/generate", json=body, headers=headers) as r:
                    if r.status != 200:
                        await r.read()
                        st["failed"] += 1
                        return
                    buf = b""
                    async for data in r.content.iter_any():
                        if first is None:
                            first = time.monotonic() - t0
                        buf += data
                        *lines, buf = buf.split(b"\n")
                        for line in lines:  # keep only the last event: it has the counts
                            if line.startswith(b"data:") and b"[DONE]" not in line:
                                last = line
            except (aiohttp.ClientError, asyncio.TimeoutError):
                st["failed"] += 1
                return
            if time.monotonic() > deadline or not last:
                if not last:
                    st["failed"] += 1
                return  # finished after the window: not counted
            meta = json.loads(last[5:]).get("meta_info", {})
            st["served"] += 1
            st["tokens"] += int(meta.get("completion_tokens", 0))
            st["ttft"].append(first)
            st["calls"].append((first, t0, meta))

        async def keep(tenant: str, slot: int, n: int) -> None:
            i = slot
            while time.monotonic() < deadline:
                await one(tenant, i)
                i += n

        tasks = [asyncio.ensure_future(keep("flood", s, args.flood)) for s in range(args.flood)]
        tasks.append(asyncio.ensure_future(keep("victim", 0, 1)))
        await asyncio.sleep(args.duration)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out = {}
    start = deadline - args.duration
    for t, st in stats.items():
        # the three slowest first tokens, with when they were asked (s into the run) and what
        # the stack said of them (its cached tokens, its own end-to-end time: a TTFT above
        # that was spent outside the stack's call, in the client or the kernel)
        worst = sorted(st.pop("calls"), key=lambda c: -c[0])[:3]
        st["slowest"] = [{"ttft_s": round(f, 4), "at_s": round(t0 - start, 2),
                          **{k: m.get(k) for k in ("cached_tokens", "e2e_latency")}}
                         for f, t0, m in worst]  # fmt: skip
        ttft = np.array(st.pop("ttft") or [np.nan])
        out[t] = {**st, "ttft_p50_s": float(np.nanpercentile(ttft, 50)),
                  "ttft_p90_s": float(np.nanpercentile(ttft, 90)),
                  "ttft_p99_s": float(np.nanpercentile(ttft, 99))}  # fmt: skip
    return out


# ---- CPU of process groups ------------------------------------------------------------------


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """Per group, each process's user+system CPU seconds so far (``groups``: root pids whose
    whole trees belong to the group, except pids claimed by an earlier group)."""
    out: dict[str, dict[int, float]] = {}
    seen: set[int] = set()
    for name, roots in groups.items():
        procs: dict[int, float] = {}
        for root in roots:
            for p in _tree(root) if name != "router" else [psutil.Process(root)]:
                if p.pid in seen:
                    continue
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = p.cpu_times()
                    procs[p.pid] = t.user + t.system
                    seen.add(p.pid)
        out[name] = procs
    return out


def cpu_delta(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]):
    return {
        name: round(sum(v - before.get(name, {}).get(pid, 0.0) for pid, v in procs.items()), 3)
        for name, procs in after.items()
    }


# ---- the stacks -----------------------------------------------------------------------------


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    import httpx

    body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 2}}
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(url + "/generate", json=body, timeout=30,
                           headers={"Authorization": "Bearer sk-victim"})  # fmt: skip
            if r.status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready in {timeout_s}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def server_args(args: argparse.Namespace) -> list[str]:
    return ["--max-running-requests", str(args.max_running)]


def run_sglang(model: Path, tmp: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    servers = [
        live_rig.SGLangServer(
            model,
            tmp / f"server-{i}.log",
            args=server_args(args),
            env=live_rig.server_env(cores=str(i)),
        )  # fmt: skip
        for i in range(2)
    ]
    gw = None
    try:
        for s in servers:
            s.start()
        port, prom = live_rig.free_port(), live_rig.free_port()
        log = tmp / "gateway.log"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--worker-urls", *[s.url for s in servers],
               "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(prom)]  # fmt: skip
        with open(log, "w") as out:
            gw = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, gw, log, 120)
        groups = {"gateway": [gw.pid], "servers": [s.proc.pid for s in servers]}
        return measure(url, groups, ("gateway",), args, vocab)
    finally:
        if gw is not None:
            _stop(gw, signal.SIGTERM)
        for s in servers:
            s.stop()


# where the editable install maps each package (pyproject's package-dir)
_PACKAGE_DIRS = {
    "router": "router", "worker": "worker", "launch": "apps/launch", "demo": "apps/demo",
    "experiment": "apps/experiment", "loadtest": "apps/loadtest", "kernels": "kernels",
    "workloads": "workloads",
}  # fmt: skip


def source_at(rev: str, tmp: Path) -> Path:
    """A directory that, first on ``PYTHONPATH``, makes ``sgl_fair`` the code at git ``rev``
    (for a before/after in one run); under ``tmp``."""
    src = tmp / f"src-{rev}"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True,
                             check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = tmp / f"pkg-{rev}"
    pkg.mkdir()
    (pkg / "sgl_fair").symlink_to(src / "sgl_fair")
    for name, rel in _PACKAGE_DIRS.items():
        link = src / "sgl_fair" / name
        if (src / rel).is_dir() and not link.exists():
            link.symlink_to(src / rel)
    return pkg


def run_ours(
    model: Path, tmp: Path, args: argparse.Namespace, vocab: int, rev: str | None = None,
    extra: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    import httpx

    tenants = tmp / "tenants.toml"
    tenants.write_text("".join(
        f'[[tenant]]\nname = "{t}"\napi_keys = ["sk-{t}"]\nadmin = {str(t == "victim").lower()}\n'
        for t in TENANTS
    ))  # fmt: skip
    port = live_rig.free_port()
    log = tmp / "launch.log"
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--backend", "sglang", "--dp", "2",
           "--model-path", str(model), "--schedule-policy", args.policy, "--port", str(port),
           "--tenants", str(tenants), "--heartbeat-timeout", "30",
           *live_rig.CPU_FLAGS, *server_args(args), *(extra or [])]  # fmt: skip
    with open(log, "w") as out:
        env = live_rig.server_env(cores="0|1")
        if rev is not None:  # our stack as it was at rev
            env["PYTHONPATH"] = os.pathsep.join([str(source_at(rev, tmp)), env["PYTHONPATH"]])
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
        )  # fmt: skip (cwd: not this checkout)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log, 600)
        info = httpx.get(url + "/server_info", headers={"Authorization": "Bearer sk-victim"},
                         timeout=10).json()  # fmt: skip
        # bridges inside the router (--bridges router) report its pid: counted as the router
        bridges = [w["pid"] for w in info["workers"] if w.get("pid") not in (None, proc.pid)]
        servers = [c.pid for c in psutil.Process(proc.pid).children()
                   if "sglang.launch_server" in " ".join(c.cmdline())]  # fmt: skip
        groups = {"router": [proc.pid], "bridges": bridges, "servers": servers}
        return measure(url, groups, ("router", "bridges"), args, vocab)
    finally:
        _stop(proc)


async def warm(url: str, args: argparse.Namespace, vocab: int) -> None:
    """``--warmup`` calls of each tenant at once, not counted (as SGLang's own
    ``bench_serving`` warms up): the servers' first forward passes and the tenants' prefixes
    are behind every stack before its measured window starts."""
    import aiohttp

    make = prompts(vocab, args.prefix_len, args.own_len)["make"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:

        async def one(tenant: str, i: int) -> None:
            body = {
                "input_ids": make(tenant, 10**6 + i),
                "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True},
                "stream": True,  # as the measured calls
            }
            headers = {"Authorization": f"Bearer sk-{tenant}"}
            async with http.post(url + "/generate", json=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"warm-up call of {tenant}: HTTP {r.status}")

        await asyncio.gather(*(one(t, i) for t in TENANTS for i in range(args.warmup)))


def measure(url: str, groups: dict[str, list[int]], relay: tuple[str, ...],
            args: argparse.Namespace, vocab: int) -> dict[str, Any]:  # fmt: skip
    if args.warmup:
        asyncio.run(warm(url, args, vocab))
    idle0 = cpu_snapshot(groups)
    time.sleep(args.idle)  # no load: each group's fixed cost (heartbeats, polls, watchdogs)
    before = cpu_snapshot(groups)
    idle = {g: round(v / args.idle, 4) for g, v in cpu_delta(idle0, before).items()}
    t0 = time.monotonic()
    tenants = asyncio.run(drive(url, args, vocab))
    wall = time.monotonic() - t0
    cpu = cpu_delta(before, cpu_snapshot(groups))
    tokens = sum(t["tokens"] for t in tenants.values())
    relay_cpu = sum(cpu[g] for g in relay)
    relay_busy = relay_cpu - sum(idle[g] for g in relay) * wall  # less the fixed cost
    return {
        "tokens": tokens,
        "tenants": tenants,
        "wall_s": round(wall, 2),
        "cpu_s": cpu,
        "relay_cpu_s": round(relay_cpu, 3),
        "tokens_per_server_cpu_s": round(tokens / max(cpu["servers"], 1e-9), 1),
        "relay_cpu_ms_per_token": round(1000 * relay_cpu / max(tokens, 1), 4),
        "idle_cpu_per_s": idle,
        "relay_busy_cpu_ms_per_token": round(1000 * relay_busy / max(tokens, 1), 4),
    }


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    def r(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    v_o, v_s = ours["tenants"]["victim"], theirs["tenants"]["victim"]
    return {
        "tokens": r(ours["tokens"], theirs["tokens"]),
        "victim_ttft_p99": r(v_o["ttft_p99_s"], v_s["ttft_p99_s"]),
        # P99 over ~100-250 calls is the worst call or two: on a saturated 2-core machine,
        # a stall of either stack's processes (or the client's); P90 is steadier
        "victim_ttft_p90": r(v_o["ttft_p90_s"], v_s["ttft_p90_s"]),
        "victim_tokens": r(v_o["tokens"], v_s["tokens"]),
        "tokens_per_server_cpu_s": r(
            ours["tokens_per_server_cpu_s"], theirs["tokens_per_server_cpu_s"]
        ),  # fmt: skip
        "relay_cpu_per_token": r(ours["relay_cpu_ms_per_token"], theirs["relay_cpu_ms_per_token"]),
        "relay_busy_cpu_per_token": r(
            ours["relay_busy_cpu_ms_per_token"], theirs["relay_busy_cpu_ms_per_token"]
        ),  # fmt: skip
    }


def table(results: dict[str, Any]) -> str:
    lines = []
    for name, r in results.items():
        if name == "ratios":
            continue
        t = r["tenants"]
        lines.append(
            f"{name:7s} tokens {r['tokens']:6d}  relay {r['relay_cpu_ms_per_token']:.3f} ms/token "
            f"({r['relay_cpu_s']:.2f} s; {r['relay_busy_cpu_ms_per_token']:.3f} less idle)  "
            f"server tokens/CPU-s {r['tokens_per_server_cpu_s']:.0f}  cpu {r['cpu_s']}  "
            f"idle cpu/s {r['idle_cpu_per_s']}"
        )
        for tn, s in t.items():
            lines.append(
                f"   {tn:6s} calls {s['served']}/{s['offered']} (failed {s['failed']})  "
                f"tokens {s['tokens']}  TTFT P50 {s['ttft_p50_s']:.3f} s  "
                f"P90 {s['ttft_p90_s']:.3f} s  P99 {s['ttft_p99_s']:.3f} s"
            )
    for name, r in results.get("ratios", {}).items():
        lines.append(f"{name}/sglang: {r}")
    return "\n".join(lines)


def load_args(
    ap: argparse.ArgumentParser, *, duration: float, idle: float, peer: str, stored_as: str
) -> None:
    """The client load's flags (this bench's and ``bench_relay.py``'s), the stacks to run and
    where the result goes."""
    ap.add_argument("--duration", type=float, default=duration)
    ap.add_argument("--flood", type=int, default=24)
    ap.add_argument("--policy", default="vtc")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--own-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--idle", type=float, default=idle, help="seconds measured without load")
    ap.add_argument("--warmup", type=int, default=4,
                    help="calls of each tenant at once before the measured window, not counted "
                    "(0: none, as before 2026-11-29l)")  # fmt: skip
    ap.add_argument("--stacks", default=f"{peer},ours",
                    help=f"{peer}, ours, ours@REV, ours+process (--bridges process)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the result here (under runs/)")
    ap.add_argument("--results", type=Path, default=None,
                    help="store it with date, commit and machine (apps/experiment/stored.py): "
                    f"a .json file, or a folder ({stored_as})")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    load_args(ap, duration=30.0, idle=5.0, peer="sglang",
              stored_as="side-by-side[-rRfF]-DATE.json")  # fmt: skip
    ap.add_argument("--max-running", type=int, default=2)
    args = ap.parse_args(argv)
    from sgl_fair.experiment import stored

    started = stored.provenance()  # the commit that runs, whatever the checkout does meanwhile
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "results")}
    }
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as d:
        tmp = Path(d)
        model = live_rig.write_tiny_llama(tmp / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        for stack in args.stacks.split(","):
            (tmp / stack).mkdir()
            if stack == "sglang":
                results[stack] = run_sglang(model, tmp / stack, args, vocab)
            else:  # "ours", "ours@REV" (our stack at a git revision), "ours+process"
                name, _, mode = stack.partition("+")
                rev = name.partition("@")[2] or None
                extra = ["--bridges", mode] if mode else []
                results[stack] = run_ours(model, tmp / stack, args, vocab, rev, extra)
            print(f"{stack}: {json.dumps(results[stack])}", flush=True)
    if "sglang" in results:
        for name in [k for k in results if k.startswith("ours")]:
            results.setdefault("ratios", {})[name] = ratios(results[name], results["sglang"])
    shown = {k: v for k, v in results.items() if k != "config"}
    print(table(shown))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.results is not None:
        default = args.max_running == 2 and args.flood == 24
        name = "side-by-side" if default else f"side-by-side-r{args.max_running}f{args.flood}"
        path = stored.write(args.results, "bench", name, results, started=started)
        print(f"stored: {path}")
    return results


if __name__ == "__main__":
    main()
