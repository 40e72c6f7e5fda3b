"""``--router-replicas R``: R router replicas over the same workers, on one host.

For trying replicas and for tests; in production each replica is its own
``python -m sgl_fair.launch --worker-endpoint ...`` and each worker its own
``python -m sgl_fair.worker --bind ...`` (docs/operators.md, "many hosts")::

    launcher (this process: starts, watches, stops)
      ├─ worker 0..dp-1      worker.remote on tcp://HOST:Q, Q+2, ...  (KV events on Q+1, ...)
      │                      or, with --backend sglang, dp SGLang servers with our plugin
      └─ replica 0..R-1      the launcher's own serve(), --worker-endpoint every worker (or
                             --worker-url every SGLang server), HTTP on --port P+i

The backend says which workers (``Backend.replica_workers``): standalone sim/torch workers
(``StandaloneWorkers``, below), or SGLang servers (``apps/launch/sglang.py``) that every
replica's bridges reach over HTTP, each server's KV events followed by every replica; over
both the replicas share one fairness state through the workers' service reports (over SGLang
servers, the plugin's ledger that each bridge reads: ``docs/replicas.md``).

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
from typing import Any, Protocol

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
    """A replica's id in the workers' service reports (its rows): new for every process, so
    that a restarted replica is a new row, never its predecessor's."""
    return random.SystemRandom().getrandbits(31)


def replica_process_config(cfg: Any) -> Any:
    """The config a replica process serves with: a new id drawn in the process itself (the
    launcher restarts a replica with the same config), where it shares service."""
    if cfg.replica_id is None:
        return cfg
    return dataclasses.replace(cfg, replica_id=new_replica_id())


def _replica_main(cfg: Any, ready_file: str) -> None:
    from sgl_fair.launch.serve import serve

    sys.exit(serve(replica_process_config(cfg), ready_file=ready_file))


def _spawn(target: Any, args: tuple, name: str, *, daemon: bool = True) -> Any:
    """A spawned process. A daemon is stopped with the launcher, but may not start processes
    of its own: a replica over SGLang servers starts its bridges, so replicas are not
    daemons (the launcher stops them itself, ``serve_replicas``)."""
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name)
    proc.daemon = daemon
    proc.start()
    return proc


class ReplicaWorkers(Protocol):
    """The workers ``--router-replicas`` starts once and puts every replica over."""

    shares_service: bool  # they report per-client service (the replicas' shared state)

    def start(self) -> None: ...

    def replica_options(self) -> dict[str, Any]:
        """The ``LaunchConfig`` fields that put a replica over these workers."""
        ...

    def describe(self) -> str:
        """The workers, for the ``ready`` line."""
        ...

    def stop(self) -> None: ...


class StandaloneWorkers:
    """``dp`` standalone sim/torch workers (``worker.remote``) on loopback tcp ports."""

    shares_service = True

    def __init__(self, cfg: Any, avoid: set[int]) -> None:
        self.cfg = cfg
        ports = free_port_pairs(cfg.host, cfg.dp, set(avoid))
        self.endpoints = [f"tcp://{cfg.host}:{q}" for q in ports]
        self.procs: list[Any] = []

    def start(self) -> None:
        from sgl_fair.worker.remote import remote_worker_main

        configs = worker_configs(self.cfg, self.endpoints)
        # a worker forgets a silent replica only after the replica would call it dead
        peer_timeout = max(15.0, self.cfg.heartbeat_timeout_s + 5.0)
        self.procs = [
            _spawn(
                remote_worker_main,
                (wcfg, ep, None, None, True, peer_timeout),
                f"sgl-fair-worker-{i}",
            )  # fmt: skip
            for i, (wcfg, ep) in enumerate(zip(configs, self.endpoints, strict=True))
        ]

    def replica_options(self) -> dict[str, Any]:
        return {"backend": "remote", "worker_endpoints": tuple(self.endpoints)}

    def describe(self) -> str:
        return f"workers {', '.join(self.endpoints)}"

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        _join(self.procs, 5.0)


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
    from sgl_fair.launch.ports import hold_ports

    r = cfg.router_replicas
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    held = hold_ports(cfg.host, [cfg.port + i for i in range(r)])
    if isinstance(held, int):  # before any worker starts: nothing to stop
        print(f"launch: error: --port {cfg.port} needs {r} free ports ({cfg.port}.."
              f"{cfg.port + r - 1}, one per replica); {held} is in use on {cfg.host}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        return _serve(cfg, r)
    finally:
        for s in held:
            s.close()


def _serve(cfg: Any, r: int) -> int:
    from sgl_fair.launch.backends import backend_of

    workers = backend_of(cfg.backend).replica_workers(cfg, {cfg.port + i for i in range(r)})
    workers.start()
    shared = cfg.replica_state != "independent" and workers.shares_service
    tmp = tempfile.mkdtemp(prefix="sgl-fair-replicas-")
    replica_cfgs = [
        dataclasses.replace(
            cfg,
            router_replicas=None,
            port=cfg.port + i,
            tenant_limits_split=r * cfg.tenant_limits_split,
            replica_id=new_replica_id() if shared else None,
            **workers.replica_options(),
        )  # fmt: skip
        for i in range(r)
    ]
    ready = [os.path.join(tmp, f"ready{i}") for i in range(r)]
    replicas = [
        _spawn(_replica_main, (c, ready[i]), f"sgl-fair-replica-{i}", daemon=False)
        for i, c in enumerate(replica_cfgs)
    ]
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        return _run(cfg, replicas, replica_cfgs, ready, lambda: stopping, workers.describe())
    finally:
        for p in replicas:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        _join(replicas, 15.0)
        workers.stop()
        with contextlib.suppress(OSError):
            for f in ready:
                if os.path.exists(f):
                    os.remove(f)
            os.rmdir(tmp)


def _run(
    cfg: Any, replicas: list[Any], replica_cfgs: list[Any], ready: list[str],
    stopping: Any, workers: str,
) -> int:  # fmt: skip
    """Wait for the replicas to start, then restart any that exits, until ``stopping()``;
    the launcher's exit status (1: a replica did not start)."""
    r = len(replicas)
    deadline = time.time() + cfg.startup_timeout_s
    while not stopping() and not all(os.path.exists(f) for f in ready):
        dead = [i for i, p in enumerate(replicas) if not p.is_alive()]
        if dead or time.time() > deadline:
            print(f"launch: error: replicas {dead or 'all'} did not start", file=sys.stderr)
            return 1
        time.sleep(0.1)
    if stopping():
        return 0
    urls = [f"http://{cfg.host}:{cfg.port + i}" for i in range(r)]
    print(f"sgl-fair replicas ready at {', '.join(urls)} (pids "
          f"{', '.join(str(p.pid) for p in replicas)}; {workers})", flush=True)  # fmt: skip
    backoff = [0.0] * r
    due: list[float | None] = [None] * r
    while not stopping():
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
                                     f"sgl-fair-replica-{i}", daemon=False)  # fmt: skip
                due[i] = None
    return 0


def _join(procs: list[Any], timeout_s: float) -> None:
    end = time.time() + timeout_s
    for p in procs:
        p.join(max(0.0, end - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)
