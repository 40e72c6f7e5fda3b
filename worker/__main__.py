"""``python -m sgl_fair.worker --bind tcp://HOST:PORT``: one worker, standalone, for routers
elsewhere (``--worker-endpoint`` on theirs). Uses PORT and PORT+1 (KV events).

Keys: ``python -m sgl_fair.worker --make-keys DIR`` writes a worker and a router certificate;
the worker then runs with ``--keys DIR`` (``DIR/worker.key_secret`` and the routers' public
certificates in ``DIR/authorized``), a router with the same folder. A non-loopback ``--bind``
without ``--keys`` is refused unless ``--insecure``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from sgl_fair.remote import ServerKeys, is_loopback, make_keys, parse_tcp


def _value(raw: str) -> Any:
    if raw in ("true", "false"):
        return raw == "true"
    if raw == "inf":
        return math.inf
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            continue
    return raw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_fair.worker", description=__doc__.split("\n")[0]
    )
    p.add_argument("--bind", metavar="tcp://HOST:PORT", help="where routers connect")
    p.add_argument("--keys", metavar="DIR", help="CURVE certificates (see --make-keys)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --bind without --keys (plain text, anyone)",
    )
    p.add_argument("--make-keys", metavar="DIR", help="write worker and router certificates, exit")
    p.add_argument("--id", type=int, default=0, help="the worker's id in its logs and messages")
    p.add_argument("--backend", choices=("sim", "torch"), default="sim")
    p.add_argument("--schedule-policy", default="dlpm")
    p.add_argument("--schedule-policy-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpu", default="H100-80GB")
    p.add_argument("--model", default="Llama-3.1-8B")
    p.add_argument("--tp", type=int)
    p.add_argument("--kv-tokens", type=int)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--kv-page-size", type=int, default=16)
    p.add_argument("--sim-eos", default="192,0.9", metavar="MEDIAN[,SIGMA]|off")
    p.add_argument("--vocab-size", type=int, help="torch presets: the router tokenizer's size")
    p.add_argument("--eos-token-id", type=int)
    p.add_argument(
        "--peer-timeout-s",
        type=float,
        default=15.0,
        help="forget a router replica silent this long, aborting its requests; keep it above "
        "the routers' --heartbeat-timeout (10 s by default), so a replica never thinks alive "
        "a worker that forgot it (default 15)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=25.0,
        help="on SIGTERM, take nothing new and finish what is held, for at most this long, "
        "then exit (a second SIGTERM, or SIGINT, stops at once; 0: SIGTERM stops at once); "
        "keep it under the pod's terminationGracePeriodSeconds (default 25)",
    )
    p.add_argument("--log-level", default="warning")
    return p  # fmt: skip


def config(a: argparse.Namespace) -> Any:
    from sgl_fair.worker.live import LiveWorkerConfig
    from sgl_fair.worker.scheduler import SchedulerConfig
    from sgl_fair.worker.sim.text import EosLengths

    opts: dict[str, Any] = {}
    for item in a.schedule_policy_opt:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--schedule-policy-opt takes KEY=VALUE (got {item!r})")
        opts[key] = _value(raw)
    sched: dict[str, Any] = {}
    if a.max_running_requests is not None:
        sched["max_running_requests"] = a.max_running_requests
    if a.chunked_prefill_size is not None:
        sched["chunked_prefill_size"] = a.chunked_prefill_size
    eos = EosLengths.parse(a.sim_eos)
    return LiveWorkerConfig(
        wid=a.id, endpoints=a.bind, policy=a.schedule_policy, policy_opts=opts, gpu=a.gpu,
        model=a.model, tp=a.tp, kv_tokens=a.kv_tokens, scheduler=SchedulerConfig(**sched),
        time_scale=a.time_scale, kv_page_size=a.kv_page_size, log_level=a.log_level,
        eos_lengths=eos, eos_token_id=a.eos_token_id if a.eos_token_id is not None else 2,
        backend=a.backend, vocab_size=a.vocab_size,
    )  # fmt: skip


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Any, Any]:
    """The checked command line: (args, its LiveWorkerConfig, its ServerKeys or None); a bad
    flag exits 2 with one line naming it. ``--make-keys`` returns (args, None, None)."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.make_keys:
        return a, None, None
    if not a.bind:
        p.error("--bind tcp://HOST:PORT is required")
    try:
        host, _port = parse_tcp(a.bind, "--bind")
        keys = None
        if a.keys:
            keys = ServerKeys(os.path.join(a.keys, "worker.key_secret"),
                              os.path.join(a.keys, "authorized"))  # fmt: skip
            for path in (keys.secret_file, keys.authorized_dir):
                if not os.path.exists(path):
                    raise ValueError(f"--keys: {path} is missing (make it with --make-keys DIR)")
        elif not is_loopback(host) and not a.insecure:
            raise ValueError(f"--bind {a.bind}: not a loopback address; give --keys DIR "
                             "(CURVE) or --insecure")  # fmt: skip
        if not a.peer_timeout_s > 0:
            raise ValueError(f"--peer-timeout-s must be > 0 (got {a.peer_timeout_s})")
        if not a.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout-s must be >= 0 (got {a.drain_timeout_s})")
        cfg = config(a)
    except ValueError as e:
        p.error(str(e))
    return a, cfg, keys


def main(argv: Sequence[str] | None = None) -> int:
    a, cfg, keys = parse(argv)
    if a.make_keys:
        paths = make_keys(a.make_keys)
        print(f"wrote {paths['worker_secret']}, {paths['router_secret']} and their public "
              f"certificates; routers accepted: {paths['authorized']}")  # fmt: skip
        return 0
    from sgl_fair.worker.remote import remote_worker_main

    print(f"sgl-fair worker {a.id} serving routers at {a.bind} ({a.backend}, "
          f"{'CURVE' if keys else 'no keys'})", flush=True)  # fmt: skip
    remote_worker_main(cfg, a.bind, keys, peer_timeout_s=a.peer_timeout_s,
                       drain_timeout_s=a.drain_timeout_s)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
