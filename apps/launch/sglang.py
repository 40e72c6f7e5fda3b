"""``--backend sglang``: the SGLang servers the launcher starts and the bridges in front of them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from sgl_fair.config import TenantTable
from sgl_fair.launch.config import LaunchConfig, local_policy_opts, share_guard_on
from sgl_fair.launch.ports import free_ports, hold_ports
from sgl_fair.launch.workers import Workers
from sgl_fair.worker.sglang.servers import ServerGroup, ServerProcess, WatchedWorker

log = logging.getLogger("sgl_fair.launch")

# ---- --backend sglang --------------------------------------------------------------------------


class SGLangWorkers(Workers):
    """``--backend sglang``: the SGLang servers (the ``dp`` the launcher starts, or the
    ``--worker-url`` ones already running) and one bridge in front of each, inside the
    router's process (``--bridges router``) or a process of its own; a worker is alive while
    both its bridge and its server are. Servers are not restarted: a start
    takes minutes and a failure usually needs an operator."""

    def __init__(self, cfg: LaunchConfig, tenants: TenantTable | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tenants = tenants
        self.servers: ServerGroup | None = None
        self.hosted: list[Any] = []  # the bridges inside this process (--bridges router)
        self.urls = list(cfg.worker_urls)
        self.kv_endpoints = list(cfg.worker_kv_endpoints) or None
        self.kv_replay_endpoints = list(cfg.worker_kv_replay_endpoints) or None
        if cfg.worker_discovery_k8s:  # the servers are pods, found at run time
            self.local_workers = 0
            self.follow_kv_events = True  # a pod that names its kv-events port is followed
            return
        if not self.urls:
            self.servers = sglang_servers(cfg, tenants)
            self.urls = [server_url(s.argv) for s in self.servers.servers]
            self.kv_endpoints = [server_kv_endpoint(s.argv) for s in self.servers.servers]
            self.kv_replay_endpoints = [server_kv_replay(s.argv) for s in self.servers.servers]
        if self.kv_endpoints is None:
            log.warning("no --worker-kv-endpoint: the router tracks the servers' caches by guess")
        self.follow_kv_events = self.kv_endpoints is not None

    def start_servers(self) -> None:
        if self.servers is not None:
            log_dir = os.path.dirname(self.servers.servers[0].log_path)
            print(f"starting {self.cfg.dp} SGLang servers (logs in {log_dir})", flush=True)
            self.servers.start()  # before any thread exists: they are forked with a death signal

    def start(self, state: Any) -> None:
        from sgl_fair.worker.sglang.bridge import Bridge
        from sgl_fair.worker.sglang.bridge_link import HostedBridge, LocalLink
        from sgl_fair.worker.sglang.relay import bridge_main

        if self.cfg.worker_discovery_k8s:
            from sgl_fair.launch.workers import k8s_discovery

            discovery = k8s_discovery(self.cfg)
            state.membership.discover(discovery, port=self.cfg.k8s_port_name or "http")
            router = state.service.router
            for u in router.workers:  # the router's first ids: no server holds them yet
                if u not in state.service.workers:
                    router.remove_worker(u)
            return
        servers = self.servers
        pids = [s.pid for s in servers.servers] if servers else [None] * len(self.urls)
        bridges = bridge_configs(
            self.cfg, state.service.endpoints.base, self.urls, pids, self.tenants
        )
        if self.cfg.bridges == "process":
            self.procs.start(bridges, bridge_main)
            self._watch(state, self.procs.procs)
            return
        service = state.service
        for bcfg in bridges:  # inside this process, on the router's loop (bridge_link)
            hosted = HostedBridge(Bridge(bcfg, LocalLink(service.deliver)))
            service.attach_local(bcfg.wid, hosted.handle)
            hosted.start()
            self.hosted.append(hosted)
        self._watch(state, self.hosted)

    def _watch(self, state: Any, bridges: Sequence[Any]) -> None:
        for i, proc in enumerate(bridges):
            watched = proc if self.servers is None else WatchedWorker(proc, self.servers.servers[i])
            state.service.watch_process(i, watched)

    async def ready(self, state: Any) -> None:
        up = [url for i, url in enumerate(self.urls)  # --min-ready-workers: the ones up
              if (w := state.service.workers.get(i)) is not None and w.ever_ready]  # fmt: skip
        infos = await probe_servers(up, self.cfg.worker_api_key)
        contexts = [x.context_len for x in infos if x.context_len]
        state.adopt_engine_limits(
            context_len=min(contexts) if contexts else None,
            model_name=next((x.model_path for x in infos if x.model_path), None),
        )

    def startup_error(self, e: Exception) -> str:
        return startup_error(e, self.servers)

    def server_links(self, state: Any) -> Any:
        from sgl_fair.launch.sglang_members import server_links

        return server_links(state, self.cfg, self.tenants)

    def stop(self) -> None:
        self.procs.stop()
        if self.servers is not None:
            self.servers.stop()


class SharedServers:
    """``--router-replicas`` over SGLang: the launcher starts the ``dp`` servers once (or
    takes the ``--worker-url`` ones) and every replica runs its own bridges to each, as a
    second router over a running server does (``--worker-url``), following each server's KV
    events beside the others. Each server's plugin keeps the service ledger of every
    replica's tagged dispatches, which each replica's bridges read (``/server_info``) and
    send with their ``Load``: the replicas share D2LPM's deficits and see each other's
    requests in the queues; the servers' own policy sees every replica's requests."""

    shares_service = True

    def __init__(self, cfg: LaunchConfig, avoid: set[int]) -> None:
        from sgl_fair.config import load_tenants

        self.cfg = cfg
        self.servers: ServerGroup | None = None
        self.urls = list(cfg.worker_urls)
        self.kv_endpoints = list(cfg.worker_kv_endpoints)
        self.kv_replay_endpoints = list(cfg.worker_kv_replay_endpoints)
        if not self.urls:
            tenants = load_tenants(cfg.tenants) if cfg.tenants else None
            self.servers = sglang_servers(cfg, tenants, avoid=sorted(avoid))
            self.urls = [server_url(s.argv) for s in self.servers.servers]
            self.kv_endpoints = [server_kv_endpoint(s.argv) for s in self.servers.servers]
            self.kv_replay_endpoints = [server_kv_replay(s.argv) for s in self.servers.servers]

    def start(self) -> None:
        if self.servers is not None:
            log_dir = os.path.dirname(self.servers.servers[0].log_path)
            print(f"starting {self.cfg.dp} SGLang servers (logs in {log_dir})", flush=True)
            self.servers.start()

    def replica_options(self) -> dict[str, Any]:
        return {
            "backend": "sglang",
            "worker_urls": tuple(self.urls),
            "worker_kv_endpoints": tuple(self.kv_endpoints),
            "worker_kv_replay_endpoints": tuple(e for e in self.kv_replay_endpoints if e),
        }

    def describe(self) -> str:
        return f"SGLang servers {', '.join(self.urls)}"

    def stop(self) -> None:
        if self.servers is not None:
            self.servers.stop()


def sglang_server_command(
    cfg: LaunchConfig,
    i: int,
    port: int,
    kv_port: int,
    *,
    replay_port: int | None = None,
    tenants: TenantTable | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of worker ``i``'s SGLang server: one data-parallel rank on
    GPUs ``i*tp ..``, HTTP on loopback ``port``, its KV events published on ``kv_port`` (and
    their last 10,000 batches replayed on ``replay_port``: a router that missed some asks), our
    local policy switched on by the plugin's environment variables. Flags the launcher does not
    know come last, so they can override any of ours."""
    from sgl_fair.worker.sglang.settings import PluginSettings

    assert cfg.model_path is not None, "--backend sglang needs --model-path"
    tp = cfg.tp or 1
    kv_events = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{kv_port}",
        "bind": True,  # a concrete loopback address: bind it (the router connects)
        "topic": "",
    }
    if replay_port is not None:
        kv_events["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--base-gpu-id", str(i * tp),
        "--tp-size", str(tp),
        "--dp-size", "1",
        "--kv-events-config", json.dumps(kv_events),
        # chunks carry only the new tokens (cumulative ones cost the square of the output)
        "--incremental-streaming-output",
    ]  # fmt: skip
    for flag, value in (
        ("--chunked-prefill-size", cfg.chunked_prefill_size),
        ("--max-running-requests", cfg.max_running_requests),
    ):
        if value is not None:  # else SGLang's own default (sized per GPU)
            argv += [flag, str(value)]
    if cfg.worker_api_key:
        argv += ["--api-key", cfg.worker_api_key]
    if cfg.context_length is not None:
        argv += ["--context-length", str(cfg.context_length)]
    if cfg.served_model_name is not None:
        argv += ["--served-model-name", cfg.served_model_name]
    if _class_aware(cfg):
        # BROS inside SGLang: the bridges send RT/BE as `priority`; SGLang then lets a waiting
        # RT request preempt running BE ones, and retracts BE first when KV runs out.
        argv += ["--enable-priority-scheduling", "--retraction-policy", "priority"]
    elif share_guard_on(cfg):
        # The share guard (worker/sglang/share_preempt.py): a waiting client below its share
        # of the running batch preempts the largest holder's least advanced request, through
        # SGLang's priority preemption (the plugin sets the priorities).
        argv += ["--enable-priority-scheduling"]
    argv += cfg.sglang_args
    env = dict(os.environ if environ is None else environ)
    env.update(PluginSettings(cfg.schedule_policy, local_policy_opts(cfg, tenants)).env())
    allowed = [x.strip() for x in env.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
    if allowed and "sgl_fair" not in allowed:  # a whitelist of SGLang plugins: add ours
        env["SGLANG_PLUGINS"] = ",".join([*allowed, "sgl_fair"])
    return argv, env


def _class_aware(cfg: LaunchConfig) -> bool:
    from sgl_fair.policies import policy_class
    from sgl_fair.worker.sglang.settings import uses_classes

    return uses_classes(policy_class(cfg.schedule_policy))


def bridge_configs(
    cfg: LaunchConfig,
    endpoints: str,
    urls: Sequence[str],
    server_pids: Sequence[int | None],
    tenants: TenantTable | None = None,
) -> list[Any]:
    """One bridge per server; each checks at start that its server's plugin runs our local
    policy (``--worker-url`` servers too: a plain SGLang server is refused)."""
    from sgl_fair.worker.sglang.bridge import BridgeConfig

    opts = local_policy_opts(cfg, tenants)
    return [
        BridgeConfig(
            wid=i,
            endpoints=endpoints,
            url=url,
            health_interval_s=cfg.health_check_interval_s,
            health_timeout_s=cfg.health_check_timeout_s,
            startup_timeout_s=cfg.startup_timeout_s,
            log_level=cfg.log_level,
            server_pid=pid,
            class_priority=_class_aware(cfg),
            api_key=cfg.worker_api_key,
            expect_policy=cfg.schedule_policy,
            expect_opts=opts,
            share_service=cfg.replica_id is not None,  # a replica that shares fairness
        )
        for i, (url, pid) in enumerate(zip(urls, server_pids, strict=True))
    ]


async def probe_servers(urls: Sequence[str], api_key: str | None = None) -> list[Any]:
    """Each server's ``ServerInfo`` (context length, model) once they are up."""
    import aiohttp

    from sgl_fair.worker.sglang.http_api import auth_headers, probe_server

    async with aiohttp.ClientSession(headers=auth_headers(api_key)) as http:
        return list(await asyncio.gather(*(probe_server(http, url, 10.0) for url in urls)))


def sglang_servers(
    cfg: LaunchConfig, tenants: TenantTable | None, avoid: Sequence[int] = ()
) -> ServerGroup:
    """The ``cfg.dp`` SGLang servers to start, each with free ports and a log file."""
    log_dir = tempfile.mkdtemp(prefix="sgl-fair-sglang-")
    for _ in range(20):  # free when chosen; held (SO_REUSEADDR, never listening) until the
        # servers bind them, so nothing else takes one meanwhile (a server once failed to
        # start: "address already in use", its port taken by an outgoing connection)
        ports = free_ports(3 * cfg.dp, avoid=(cfg.port, *avoid))
        held = hold_ports("127.0.0.1", ports)
        if not isinstance(held, int):
            break
    else:
        raise RuntimeError("no free ports on 127.0.0.1 for the SGLang servers")
    servers = []
    for i in range(cfg.dp):
        argv, env = sglang_server_command(
            cfg, i, ports[3 * i], ports[3 * i + 1], replay_port=ports[3 * i + 2],
            tenants=tenants, environ=os.environ,
        )  # fmt: skip
        servers.append(ServerProcess(i, argv, env, os.path.join(log_dir, f"server-{i}.log")))
    return ServerGroup(servers, held)


def _flag(argv: Sequence[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last one wins, as in argparse


def server_url(argv: Sequence[str]) -> str:
    return f"http://{_flag(argv, '--host')}:{_flag(argv, '--port')}"


def server_kv_endpoint(argv: Sequence[str]) -> str:
    endpoint = json.loads(_flag(argv, "--kv-events-config"))["endpoint"]
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


def server_kv_replay(argv: Sequence[str]) -> str | None:
    """The server's KV-event replay endpoint, if its ``--kv-events-config`` names one."""
    endpoint = json.loads(_flag(argv, "--kv-events-config")).get("replay_endpoint")
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:") if endpoint else None


def startup_error(e: Exception, servers: ServerGroup | None) -> str:
    dead = servers.first_exit() if servers is not None else None
    if dead is None:
        return str(e)
    tail = "\n".join("    " + line for line in dead.log_tail().splitlines())
    return (
        f"SGLang server {dead.index} exited with code {dead.exitcode()} during start-up "
        f"(log: {dead.log_path}); its last lines:\n{tail}"
    )
