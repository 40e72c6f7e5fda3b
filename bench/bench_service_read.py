"""What a router replica's read of the plugin's service ledger costs an SGLang server (issue 40).

Replicas over SGLang servers share D2LPM's state through the plugin's ledger, which each
replica's bridge reads from ``/server_info`` every 0.5 s (``worker/sglang/bridge.py``); the
read goes through SGLang's tokenizer manager to the scheduler, between two of its steps. One
live server on this CPU (the tiny random Llama of ``tests/sglang/live_rig.py``, our plugin
with vtc), idle and then with ``--rows`` (replica, client) rows in its ledger (tagged
requests of that many clients, one output token each): the latency of ``/server_info``
(P50, P99 over ``--reads`` reads) and the bytes of the plugin's share of it.

    .venv/bin/python bench/bench_service_read.py [--reads 50] [--rows 1000]
        [--results bench/results/service-read-DATE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

import live_rig  # noqa: E402

from sgl_fair.request import TAG_PARAM  # noqa: E402


def reads(url: str, n: int) -> dict[str, Any]:
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = httpx.get(url + "/server_info", timeout=30)
        times.append(time.perf_counter() - t0)
        plugin = r.json()["internal_states"][0]["sgl_fair"]
        size = len(json.dumps(plugin["service"]))
        time.sleep(0.05)
    times.sort()
    return {"p50_ms": round(1e3 * statistics.median(times), 2),
            "p99_ms": round(1e3 * times[int(0.99 * (len(times) - 1))], 2),
            "service_bytes": size}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=50)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args(argv)
    from sgl_fair.experiment import stored

    started = stored.provenance()
    out: dict[str, Any] = {"config": {"reads": args.reads, "rows": args.rows}}
    with tempfile.TemporaryDirectory(prefix="service-read-") as d:
        tmp = Path(d)
        model = live_rig.write_tiny_llama(tmp / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        env = live_rig.server_env(extra={"SGLFAIR_SCHEDULE_POLICY": "vtc"})
        server = live_rig.SGLangServer(model, tmp / "server.log", env=env).start()
        try:
            out["idle"] = reads(server.url, args.reads)
            for i in range(args.rows):  # one row per client: replica 1, charge 10
                body = {"input_ids": [11, 12, 13, 10 + i % (vocab - 10)], "routing_key": f"c{i}",
                        "sampling_params": {"max_new_tokens": 1,
                                            "custom_params": {TAG_PARAM: [1, 10]}}}  # fmt: skip
                try:
                    r = httpx.post(server.url + "/generate", json=body, timeout=60)
                except httpx.HTTPError:
                    print(server.log_path.read_text()[-4000:], file=sys.stderr)
                    raise
                r.raise_for_status()
            out[f"rows_{args.rows}"] = reads(server.url, args.reads)
        finally:
            server.stop()
    print(json.dumps(out))
    if args.results is not None:
        path = stored.write(args.results, "bench", "service-read", out, started=started)
        print(f"stored: {path}")
    return out


if __name__ == "__main__":
    main()
