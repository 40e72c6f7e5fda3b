"""``python -m sgl_fair.launch --dp 4``: one router process (HTTP front + router) and N workers.

::

    clients ──HTTP──▶ router process (this one): uvicorn + Starlette, the global router
                         │ zmq (ipc in a private temp dir)
                         ├──▶ worker 0 process: scheduler + simulated engine (wall clock)
                         ├──▶ …
                         └──▶ worker N-1

``--backend sglang`` puts real SGLang servers behind the same router: the launcher starts one
``sglang.launch_server`` per worker (our local policy switched on inside it by the plugin's
environment variables; flags we do not know are passed through to every server) and one
bridge process per server that speaks the worker protocol to the router and HTTP to the
server; the router follows each server's KV events directly::

    router ──zmq──▶ bridge i ──HTTP──▶ SGLang server i (GPUs i*tp ..)   KV events ──zmq──▶ router

``--worker-url URL`` (repeated) does the same for servers that are already running: only the
bridges are started (``--worker-kv-endpoint`` names their KV-event publishers).

Flags follow SGLang's ``ServerArgs`` names where SGLang has one. Ctrl-C / SIGTERM stop the
server, tell every worker to stop, wait for them (killing stragglers), stop the SGLang servers
it started and remove the sockets. Errors in flags, the tenants file or the model path are one
line naming the flag, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.config import ConfigError, TenantTable, load_tenants
from sgl_fair.policies import make_policy, policy_class, policy_names
from sgl_fair.router.policies import make_router_policy, router_policy_names
from sgl_fair.worker.sglang.servers import ServerGroup, ServerProcess, WatchedWorker
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.hardware import GPUS, MODELS, get_gpu, get_model

log = logging.getLogger("sgl_fair.launch")


@dataclass(frozen=True)
class LaunchConfig:
    dp: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str | None = None
    served_model_name: str | None = None
    schedule_policy: str = "dlpm"
    schedule_policy_opts: dict[str, Any] = field(default_factory=dict)
    router_policy: str = "d2lpm"
    router_policy_opts: dict[str, Any] = field(default_factory=dict)
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256
    backend: str = "sim"
    gpu: str = "H100-80GB"
    model: str = "Llama-3.1-8B"
    tp: int | None = None
    kv_tokens: int | None = None
    time_scale: float = 1.0
    context_length: int | None = None
    tenants: str | None = None
    log_level: str = "warning"
    max_body_bytes: int = 16 << 20
    kv_page_size: int = 16
    heartbeat_timeout_s: float = 10.0
    startup_timeout_s: float = 120.0
    max_tree_tokens: int | None = 4_000_000
    # --backend sglang
    worker_urls: tuple[str, ...] = ()  # servers already running (else the launcher starts dp)
    worker_kv_endpoints: tuple[str, ...] = ()
    sglang_args: tuple[str, ...] = ()  # passed through to every server the launcher starts
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 30.0


def _kv(items: Sequence[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE (got {item!r})")
        value: Any = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                continue
        if raw in ("true", "false"):
            value = raw == "true"
        if raw in ("inf", "none"):
            value = math.inf if raw == "inf" else None
        out[key] = value
    return out


def gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_fair.launch",
        description="Start the sgl-fair router and data-parallel workers behind one HTTP API "
        "(SGLang-native /generate and OpenAI-compatible /v1).",
    )
    p.add_argument("--dp-size", "--dp", dest="dp", type=int, default=None, help="workers (GPUs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model-path",
        default=None,
        help="a local model directory with a Hugging Face tokenizer (else: built-in tokenizer; "
        "a hub name is used as the served model name only)",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--schedule-policy", default="dlpm", help="local policy: " + ", ".join(policy_names())
    )
    p.add_argument("--schedule-policy-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--router-policy",
        default="d2lpm",
        help="router policy: " + ", ".join(router_policy_names()),
    )
    p.add_argument("--router-policy-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument(
        "--backend", choices=("sim", "sglang"), default=None,
        help="engine: 'sim' (simulated GPU; the default) or 'sglang' (real SGLang servers; "
        "implied by --worker-url). With sglang, flags this launcher does not know are passed "
        "to every SGLang server it starts",
    )  # fmt: skip
    p.add_argument(
        "--worker-url", action="append", default=[], metavar="URL",
        help="sglang: an SGLang server that is already running (repeat: one per worker; "
        "dp = their number); the launcher then starts no server",
    )  # fmt: skip
    p.add_argument(
        "--worker-kv-endpoint", action="append", default=[], metavar="EP",
        help="sglang: the KV-event publisher of each --worker-url, in order (e.g. "
        "tcp://host:5557); without it the router guesses the caches from what it routed",
    )  # fmt: skip
    p.add_argument(
        "--health-check-interval", type=float, default=5.0, metavar="S",
        help="sglang: seconds between a bridge's /health checks of its server",
    )  # fmt: skip
    p.add_argument(
        "--health-check-timeout", type=float, default=30.0, metavar="S",
        help="sglang: a server whose /health fails this long is taken out of routing",
    )  # fmt: skip
    p.add_argument("--gpu", default="H100-80GB", help="sim: " + ", ".join(GPUS))
    p.add_argument("--model", default="Llama-3.1-8B", help="sim: " + ", ".join(MODELS))
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=None, help="sim: KV pool per worker (tokens)")
    p.add_argument(
        "--time-scale", type=float, default=1.0,
        help="sim: simulated seconds per wall second (2 = twice as fast as the GPU; "
        "inf = zero-cost engine)",
    )  # fmt: skip
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--tenants", default=None, metavar="FILE", help="tenants TOML (keys, weights)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.add_argument("--max-body-bytes", type=int, default=16 << 20)
    p.add_argument("--kv-page-size", type=int, default=16, help="KV-event block size (tokens)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S")
    p.add_argument(
        "--startup-timeout", type=float, default=None, metavar="S",
        help="wait this long for every worker (default: 120; sglang: 900, loading a model "
        "takes minutes)",
    )  # fmt: skip
    return p


_URL = re.compile(r"https?://[^/\s]+(/\S*)?")


def parse_config(argv: Sequence[str] | None = None) -> LaunchConfig:
    parser = build_parser()
    a, passthrough = parser.parse_known_args(argv)

    def bad(msg: str) -> None:
        parser.error(msg)  # exits 2 with the usage line and the message

    backend = a.backend or ("sglang" if a.worker_url else "sim")
    if passthrough and backend != "sglang":
        bad("unrecognized arguments: " + " ".join(passthrough))
    dp = _check_sglang(a, backend, passthrough, bad)
    if dp < 1:
        bad(f"--dp must be >= 1 (got {dp})")
    if not 0 <= a.port <= 65535:
        bad(f"--port must be in 0..65535 (got {a.port})")
    if a.schedule_policy not in policy_names():
        bad(f"--schedule-policy {a.schedule_policy!r} is unknown; choose from {policy_names()}")
    if a.router_policy not in router_policy_names():
        bad(f"--router-policy {a.router_policy!r} is unknown; choose from {router_policy_names()}")
    for name in ("chunked_prefill_size", "max_running_requests", "kv_page_size", "max_body_bytes"):
        if getattr(a, name) < 1:
            bad(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if not a.time_scale > 0:
        bad(f"--time-scale must be > 0 (got {a.time_scale})")
    try:
        get_gpu(a.gpu)
    except (KeyError, ValueError):
        bad(f"--gpu {a.gpu!r} is unknown; choose from {sorted(GPUS)}")
    try:
        get_model(a.model)
    except (KeyError, ValueError):
        bad(f"--model {a.model!r} is unknown; choose from {sorted(MODELS)}")
    try:
        CostModel.from_names(a.gpu, a.model, tp=a.tp if backend == "sim" else None)
    except ValueError as e:
        bad(f"--gpu/--model/--tp: {e}")
    if a.tp is not None and a.tp < 1:
        bad(f"--tp must be >= 1 (got {a.tp})")
    if a.context_length is not None and a.context_length < 2:
        bad(f"--context-length must be >= 2 (got {a.context_length})")
    if a.kv_tokens is not None and a.kv_tokens < 16:
        bad(f"--kv-tokens must be >= 16 (got {a.kv_tokens})")
    for flag, value in (
        ("--health-check-interval", a.health_check_interval),
        ("--health-check-timeout", a.health_check_timeout),
        ("--startup-timeout", a.startup_timeout),
    ):
        if value is not None and not value > 0:
            bad(f"{flag} must be > 0 (got {value})")
    if a.backend is None and backend == "sim" and gpu_visible():
        log.warning("a GPU is visible; using the simulator (--backend sglang runs SGLang)")
    startup_timeout = a.startup_timeout
    if startup_timeout is None:
        startup_timeout = 900.0 if backend == "sglang" else 120.0
    try:
        sched_opts = _kv(a.schedule_policy_opt, "--schedule-policy-opt")
        router_opts = _kv(a.router_policy_opt, "--router-policy-opt")
        make_policy(a.schedule_policy, **sched_opts)
        make_router_policy(a.router_policy, **router_opts)
    except ValueError as e:
        bad(str(e))
    if a.tenants is not None:
        try:
            load_tenants(a.tenants)
        except ConfigError as e:
            bad(f"--tenants: {e}")
    return LaunchConfig(
        dp=dp,
        host=a.host,
        port=a.port,
        model_path=a.model_path,
        served_model_name=a.served_model_name,
        schedule_policy=a.schedule_policy,
        schedule_policy_opts=sched_opts,
        router_policy=a.router_policy,
        router_policy_opts=router_opts,
        chunked_prefill_size=a.chunked_prefill_size,
        max_running_requests=a.max_running_requests,
        backend=backend,
        gpu=a.gpu,
        model=a.model,
        tp=a.tp,
        kv_tokens=a.kv_tokens,
        time_scale=a.time_scale,
        context_length=a.context_length,
        tenants=a.tenants,
        log_level=a.log_level,
        max_body_bytes=a.max_body_bytes,
        kv_page_size=a.kv_page_size,
        heartbeat_timeout_s=a.heartbeat_timeout,
        startup_timeout_s=startup_timeout,
        worker_urls=tuple(u.rstrip("/") for u in a.worker_url),
        worker_kv_endpoints=tuple(a.worker_kv_endpoint),
        sglang_args=tuple(passthrough),
        health_check_interval_s=a.health_check_interval,
        health_check_timeout_s=a.health_check_timeout,
    )


def _check_sglang(a: argparse.Namespace, backend: str, passthrough: list[str], bad: Any) -> int:
    """The --backend sglang flags' checks; returns dp (the number of --worker-url if given)."""
    urls, kv = a.worker_url, a.worker_kv_endpoint
    if backend != "sglang":
        if urls or kv:
            bad("--worker-url / --worker-kv-endpoint need --backend sglang")
        return 1 if a.dp is None else a.dp
    if not urls:
        if kv:
            bad("--worker-kv-endpoint needs --worker-url (the servers it belongs to)")
        if not a.model_path:
            bad(
                "--backend sglang needs --model-path (the model each SGLang server loads) "
                "or --worker-url (SGLang servers already running)"
            )
        return 1 if a.dp is None else a.dp
    if a.dp is not None and a.dp != len(urls):
        bad(f"--dp {a.dp} does not match the {len(urls)} --worker-url given (one per worker)")
    for url in urls:
        if not _URL.fullmatch(url):
            bad(f"--worker-url {url!r} is not an http:// or https:// URL")
    if kv and len(kv) != len(urls):
        bad(
            f"--worker-kv-endpoint given {len(kv)} times for {len(urls)} --worker-url; "
            "give one per URL, in the same order, or none"
        )
    for ep in kv:
        if not ep.startswith(("tcp://", "ipc://")):
            bad(f"--worker-kv-endpoint {ep!r} is not a zmq tcp:// or ipc:// endpoint")
    if passthrough:
        bad(
            f"{' '.join(passthrough)}: unknown flags go to the SGLang servers the launcher "
            "starts; with --worker-url it starts none"
        )
    return len(urls)


def local_policy_opts(cfg: LaunchConfig, tenants: TenantTable | None) -> dict[str, Any]:
    """The local policy's options, with tenant weights where the policy takes weights."""
    opts = dict(cfg.schedule_policy_opts)
    if tenants is not None and tenants.weights and "weights" not in opts:
        cls = policy_class(cfg.schedule_policy)
        fields_ = getattr(cls.Config, "__dataclass_fields__", {})
        if "weights" in fields_:
            opts["weights"] = dict(tenants.weights)
    return opts


# ---- --backend sglang --------------------------------------------------------------------------


def sglang_server_command(
    cfg: LaunchConfig,
    i: int,
    port: int,
    kv_port: int,
    *,
    tenants: TenantTable | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of worker ``i``'s SGLang server: one data-parallel rank on
    GPUs ``i*tp ..``, HTTP on loopback ``port``, its KV events published on ``kv_port``, our
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
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--base-gpu-id", str(i * tp),
        "--tp-size", str(tp),
        "--dp-size", "1",
        "--kv-events-config", json.dumps(kv_events),
        "--chunked-prefill-size", str(cfg.chunked_prefill_size),
        "--max-running-requests", str(cfg.max_running_requests),
    ]  # fmt: skip
    if cfg.context_length is not None:
        argv += ["--context-length", str(cfg.context_length)]
    if cfg.served_model_name is not None:
        argv += ["--served-model-name", cfg.served_model_name]
    argv += cfg.sglang_args
    env = dict(os.environ if environ is None else environ)
    env.update(PluginSettings(cfg.schedule_policy, local_policy_opts(cfg, tenants)).env())
    allowed = [x.strip() for x in env.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
    if allowed and "sgl_fair" not in allowed:  # a whitelist of SGLang plugins: add ours
        env["SGLANG_PLUGINS"] = ",".join([*allowed, "sgl_fair"])
    return argv, env


def free_ports(n: int, host: str = "127.0.0.1", *, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports that are free on ``host`` now."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in ports and port not in avoid:
            ports.append(port)
    return ports


def bridge_configs(
    cfg: LaunchConfig, endpoints: str, urls: Sequence[str], server_pids: Sequence[int | None]
) -> list[Any]:
    from sgl_fair.worker.sglang.bridge import BridgeConfig

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
        )
        for i, (url, pid) in enumerate(zip(urls, server_pids, strict=True))
    ]


async def probe_servers(urls: Sequence[str]) -> list[Any]:
    """Each server's ``ServerInfo`` (context length, model) once they are up."""
    import aiohttp

    from sgl_fair.worker.sglang.bridge import probe_server

    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(probe_server(http, url, 10.0) for url in urls)))


# ---- processes ---------------------------------------------------------------------------------


class ProcessGroup:
    """The worker processes: start them, watch them, stop them (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.Process] = []

    def start(self, configs: Sequence[Any], target: Any = None) -> None:
        """One process per config running ``target(config)`` (default: a simulated worker)."""
        if target is None:
            from sgl_fair.worker.live import worker_main as target

        ctx = multiprocessing.get_context("spawn")
        for wcfg in configs:
            proc = ctx.Process(target=target, args=(wcfg,), name=f"sgl-fair-worker-{wcfg.wid}")
            proc.daemon = True
            proc.start()
            self.procs.append(proc)

    def stop(self, timeout_s: float = 5.0) -> None:
        for proc in self.procs:
            proc.join(timeout_s / max(len(self.procs), 1))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve(cfg: LaunchConfig, *, ready_file: str | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    try:
        import uvloop
    except ImportError:  # uvloop is optional (not on Windows): plain asyncio then
        uvloop = None

    from sgl_fair.router.server import ServerState, build_app
    from sgl_fair.router.tokenizer import BuiltinTokenizer, load_tokenizer
    from sgl_fair.worker.sglang.bridge import bridge_main

    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        tokenizer = load_tokenizer(cfg.model_path)
    except ValueError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2
    sglang = cfg.backend == "sglang"
    if sglang and isinstance(tokenizer, BuiltinTokenizer):
        if not cfg.worker_urls:
            print(
                f"launch: error: --model-path {cfg.model_path!r}: --backend sglang needs a local "
                "model directory (the router tokenizes prompts with its tokenizer.json); "
                "download the model first",
                file=sys.stderr,
            )
            return 2
        log.warning("no --model-path: prompts are tokenized with the built-in tokenizer")
    tenants = load_tenants(cfg.tenants) if cfg.tenants else None
    if cfg.port and not port_free(cfg.host, cfg.port):
        print(f"launch: error: --port {cfg.port} is already in use on {cfg.host}", file=sys.stderr)
        return 2
    servers = None
    urls: list[str] = list(cfg.worker_urls)
    kv_endpoints: list[str] | None = list(cfg.worker_kv_endpoints) or None
    if sglang and not urls:
        servers = sglang_servers(cfg, tenants)
        urls = [_url_of(s.argv) for s in servers.servers]
        kv_endpoints = [_kv_endpoint_of(s.argv) for s in servers.servers]
    if sglang and kv_endpoints is None:
        log.warning("no --worker-kv-endpoint: the router tracks the servers' caches by guess")
    ipc_dir = tempfile.mkdtemp(prefix="sgl-fair-")
    state = ServerState.create(
        cfg,
        tokenizer=tokenizer,
        tenants=tenants,
        ipc_dir=ipc_dir,
        kv_endpoints=kv_endpoints,
        worker_urls=urls,
        follow_kv_events=not sglang or kv_endpoints is not None,
    )
    procs = ProcessGroup()

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else cfg.port
                url = f"http://{cfg.host}:{port}"
                state.url = url
                print(f"sgl-fair ready at {url}  ({state.describe()})", flush=True)
                if ready_file:
                    with open(ready_file, "w") as f:
                        f.write(url)

    def stop_all() -> None:
        procs.stop()
        if servers is not None:
            servers.stop()

    async def on_shutdown() -> None:
        await state.service.close()
        await asyncio.get_running_loop().run_in_executor(None, stop_all)

    async def run() -> int:
        # Workers first, outside uvicorn: a start-up failure is one line, not a traceback.
        await state.service.start()
        if sglang:
            pids = [s.pid for s in servers.servers] if servers else [None] * len(urls)
            procs.start(bridge_configs(cfg, state.service.endpoints.base, urls, pids), bridge_main)
        else:
            procs.start(state.worker_configs())
        for i, proc in enumerate(procs.procs):
            watched = proc if servers is None else WatchedWorker(proc, servers.servers[i])
            state.service.watch_process(i, watched)
        try:
            await state.service.wait_ready(cfg.startup_timeout_s)
        except (TimeoutError, RuntimeError) as e:
            print(f"launch: error: {_startup_error(e, servers)}", file=sys.stderr)
            await state.service.close()
            return 1
        if sglang:
            infos = await probe_servers(urls)
            contexts = [x.context_len for x in infos if x.context_len]
            state.adopt_engine_limits(
                context_len=min(contexts) if contexts else None,
                model_name=next((x.model_path for x in infos if x.model_path), None),
            )
        server = Server(
            uvicorn.Config(
                build_app(state, on_shutdown=on_shutdown),
                host=cfg.host,
                port=cfg.port,
                http="httptools",
                lifespan="on",
                log_level=cfg.log_level,
                access_log=cfg.log_level == "debug",
                timeout_graceful_shutdown=5,
            )
        )
        await server.serve()
        return 0 if server.started else 1

    if servers is not None:
        log_dir = os.path.dirname(servers.servers[0].log_path)
        print(f"starting {cfg.dp} SGLang servers (logs in {log_dir})", flush=True)
        servers.start()  # before any thread exists: they are forked with a death signal
    try:
        runner = getattr(uvloop, "run", None) if uvloop is not None else None
        return runner(run()) if runner is not None else asyncio.run(run())
    finally:
        stop_all()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def sglang_servers(cfg: LaunchConfig, tenants: TenantTable | None) -> ServerGroup:
    """The ``cfg.dp`` SGLang servers to start, each with free ports and a log file."""
    log_dir = tempfile.mkdtemp(prefix="sgl-fair-sglang-")
    ports = free_ports(2 * cfg.dp, avoid=(cfg.port,))
    servers = []
    for i in range(cfg.dp):
        argv, env = sglang_server_command(
            cfg, i, ports[2 * i], ports[2 * i + 1], tenants=tenants, environ=os.environ
        )
        servers.append(ServerProcess(i, argv, env, os.path.join(log_dir, f"server-{i}.log")))
    return ServerGroup(servers)


def _flag(argv: Sequence[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last one wins, as in argparse


def _url_of(argv: Sequence[str]) -> str:
    return f"http://{_flag(argv, '--host')}:{_flag(argv, '--port')}"


def _kv_endpoint_of(argv: Sequence[str]) -> str:
    endpoint = json.loads(_flag(argv, "--kv-events-config"))["endpoint"]
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


def _startup_error(e: Exception, servers: ServerGroup | None) -> str:
    dead = servers.first_exit() if servers is not None else None
    if dead is None:
        return str(e)
    tail = "\n".join("    " + line for line in dead.log_tail().splitlines())
    return (
        f"SGLang server {dead.index} exited with code {dead.exitcode()} during start-up "
        f"(log: {dead.log_path}); its last lines:\n{tail}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
