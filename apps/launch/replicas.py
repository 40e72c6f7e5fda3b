"""``--router-replicas R``: R router replicas over the same workers, on one host.

For trying replicas and for tests; in production each replica is its own
``python -m sgl_fair.launch --worker-endpoint ...`` and each worker its own
``python -m sgl_fair.worker --bind ...`` (docs/operators.md, "many hosts")::

    launcher (this process: starts, watches, stops)
      ├─ worker 0..dp-1      worker.remote on tcp://HOST:Q, Q+2, ...  (KV events on Q+1, ...)
      └─ replica 0..R-1      the launcher's own serve(), --worker-endpoint every worker,
                             HTTP on --port P+i

Tenants, keys and limits come from the same ``--tenants`` file in every replica. The limits
that must hold for the whole cluster are split: each replica enforces ``1/R`` of every
tenant's ``max_inflight`` (rounded up), ``rpm`` and ``burst`` (``--tenant-limits-split R``, which a
replica started by hand takes too), so behind a load balancer that spreads a tenant's
requests evenly the cluster admits what the file says. ``weight`` and ``max_input_tokens``
are not split (they are not totals). A replica that exits is started again after
``--worker-restart-backoff`` (doubling, 30 s at most); its open streams are lost, the other
replicas serve on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import random
import signal
import socket
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from sgl_fair.config import Tenant, TenantDefaults, TenantTable

log = logging.getLogger("sgl_fair.launch")


def client_keys(cfg: Any) -> Any:
    """The router's CURVE keys for its remote workers (``--worker-keys DIR``), or None."""
    from sgl_fair.remote import ClientKeys

    if not cfg.worker_keys:
        return None
    d = cfg.worker_keys
    return ClientKeys(os.path.join(d, "router.key_secret"), os.path.join(d, "worker.key"))


def split_limits(table: TenantTable, r: int) -> TenantTable:
    """Each tenant's (and the defaults') cluster-wide limits divided over ``r`` replicas."""
    if r <= 1:
        return table

    def cut(x: Any) -> Any:
        if x is None:
            return None
        return max(1, math.ceil(x / r)) if isinstance(x, int) else x / r

    def split(t: Any) -> Any:
        burst = None if t.burst is None else max(1.0, t.burst / r)
        return dataclasses.replace(
            t, max_inflight=cut(t.max_inflight), rpm=None if t.rpm is None else t.rpm / r,
            burst=burst,
        )  # fmt: skip

    tenants: list[Tenant] = [split(t) for t in table.tenants]
    defaults: TenantDefaults = split(table.defaults)
    return TenantTable(tenants, defaults, source=f"{table.source} (1/{r} per replica)")


def free_port_pairs(host: str, n: int, avoid: set[int]) -> list[int]:
    """``n`` ports Q with Q and Q+1 free on ``host`` (a worker's endpoint and its KV events)."""
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + 1 >= 65535 or {port, port + 1} & avoid:
            continue
        with socket.socket() as s2:
            try:
                s2.bind((host, port + 1))
            except OSError:
                continue
        avoid |= {port, port + 1}
        out.append(port)
    return out


def new_replica_id() -> int:
    """A replica's id in the workers' service reports: new for every process, so that a
    restarted replica's dispatch count never mixes with its predecessor's."""
    return random.getrandbits(31)


def _replica_main(cfg: Any, ready_file: str) -> None:
    from sgl_fair.launch.serve import serve

    sys.exit(serve(cfg, ready_file=ready_file))


def _spawn(target: Any, args: tuple, name: str) -> Any:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name)
    proc.daemon = True  # stopped with the launcher (neither kind starts processes of its own)
    proc.start()
    return proc


def worker_configs(cfg: Any, endpoints: list[str]) -> list[Any]:
    """One ``LiveWorkerConfig`` per standalone worker, as the launcher's own workers get."""
    from sgl_fair.config import load_tenants
    from sgl_fair.launch.backends import backend_of
    from sgl_fair.launch.workers import sim_worker_configs
    from sgl_fair.router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model_path)
    tenants = load_tenants(cfg.tenants) if cfg.tenants else None
    state = SimpleNamespace(
        tokenizer=tokenizer, tenants=tenants,
        service=SimpleNamespace(endpoints=SimpleNamespace(base="unused")),
    )  # fmt: skip
    return sim_worker_configs(cfg, state, backend_of(cfg.backend))


def serve_replicas(cfg: Any) -> int:
    """Start the workers and the replicas; run until SIGINT/SIGTERM; stop them all."""
    from sgl_fair.worker.remote import remote_worker_main

    r = cfg.router_replicas
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    ports = free_port_pairs(cfg.host, cfg.dp, {cfg.port + i for i in range(r)})
    endpoints = [f"tcp://{cfg.host}:{q}" for q in ports]
    workers = [
        _spawn(remote_worker_main, (wcfg, ep, None, None, True), f"sgl-fair-worker-{i}")
        for i, (wcfg, ep) in enumerate(zip(worker_configs(cfg, endpoints), endpoints, strict=True))
    ]
    tmp = tempfile.mkdtemp(prefix="sgl-fair-replicas-")
    replica_cfgs = [
        dataclasses.replace(
            cfg,
            router_replicas=None,
            port=cfg.port + i,
            backend="remote",
            worker_endpoints=tuple(endpoints),
            tenant_limits_split=r * cfg.tenant_limits_split,
            replica_id=None if cfg.replica_state == "independent" else new_replica_id(),
        )  # fmt: skip
        for i in range(r)
    ]
    ready = [os.path.join(tmp, f"ready{i}") for i in range(r)]
    replicas = [
        _spawn(_replica_main, (c, ready[i]), f"sgl-fair-replica-{i}")
        for i, c in enumerate(replica_cfgs)
    ]
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    deadline = time.time() + cfg.startup_timeout_s
    while not stopping and not all(os.path.exists(f) for f in ready):
        dead = [i for i, p in enumerate(replicas) if not p.is_alive()]
        if dead or time.time() > deadline:
            print(f"launch: error: replicas {dead or 'all'} did not start", file=sys.stderr)
            stopping = True
            break
        time.sleep(0.1)
    if not stopping:
        urls = [f"http://{cfg.host}:{cfg.port + i}" for i in range(r)]
        print(f"sgl-fair replicas ready at {', '.join(urls)} (pids "
              f"{', '.join(str(p.pid) for p in replicas)}; workers {', '.join(endpoints)})",
              flush=True)  # fmt: skip
    backoff = [0.0] * r
    due: list[float | None] = [None] * r
    while not stopping:
        time.sleep(0.2)
        for i, p in enumerate(replicas):
            if p.is_alive() or cfg.worker_restart_backoff_s <= 0:
                continue
            now = time.time()
            if due[i] is None:
                backoff[i] = min(30.0, 2 * backoff[i] or cfg.worker_restart_backoff_s)
                due[i] = now + backoff[i]
                log.warning("replica %d exited (%s); restarting in %.1fs", i, p.exitcode,
                            backoff[i])  # fmt: skip
            elif now >= due[i]:
                p.join(0.1)
                replicas[i] = _spawn(_replica_main, (replica_cfgs[i], ready[i]),
                                     f"sgl-fair-replica-{i}")  # fmt: skip
                due[i] = None
    for p in replicas:
        if p.is_alive():
            os.kill(p.pid, signal.SIGINT)
    _join(replicas, 15.0)
    for p in workers:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    _join(workers, 5.0)
    with contextlib.suppress(OSError):
        for f in ready:
            if os.path.exists(f):
                os.remove(f)
        os.rmdir(tmp)
    return 0


def _join(procs: list[Any], timeout_s: float) -> None:
    end = time.time() + timeout_s
    for p in procs:
        p.join(max(0.0, end - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)
