"""``python -m sgl_fair.launch --dp 4``: one router process (HTTP front + router) and N workers.

::

    clients ──HTTP──▶ router process (this one): uvicorn + Starlette, the global router
                         │ zmq (ipc in a private temp dir)
                         ├──▶ worker 0 process: scheduler + simulated engine (wall clock)
                         ├──▶ …
                         └──▶ worker N-1

Flags follow SGLang's ``ServerArgs`` names where SGLang has one. Ctrl-C / SIGTERM stop the
server, tell every worker to stop, wait for them (killing stragglers) and remove the sockets.
Errors in flags, the tenants file or the model path are one line naming the flag, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.config import ConfigError, TenantTable, load_tenants
from sgl_fair.policies import make_policy, policy_class, policy_names
from sgl_fair.router.policies import make_router_policy, router_policy_names
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
    p.add_argument("--dp-size", "--dp", dest="dp", type=int, default=1, help="workers (GPUs)")
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
        help="engine: 'sim' (simulated GPU, the default where no GPU is visible) or 'sglang'",
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
    p.add_argument("--startup-timeout", type=float, default=120.0, metavar="S")
    return p


def parse_config(argv: Sequence[str] | None = None) -> LaunchConfig:
    parser = build_parser()
    a = parser.parse_args(argv)

    def bad(msg: str) -> None:
        parser.error(msg)  # exits 2 with the usage line and the message

    if a.dp < 1:
        bad(f"--dp must be >= 1 (got {a.dp})")
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
        CostModel.from_names(a.gpu, a.model, tp=a.tp)
    except ValueError as e:
        bad(f"--gpu/--model/--tp: {e}")
    if a.context_length is not None and a.context_length < 2:
        bad(f"--context-length must be >= 2 (got {a.context_length})")
    if a.kv_tokens is not None and a.kv_tokens < 16:
        bad(f"--kv-tokens must be >= 16 (got {a.kv_tokens})")
    backend = a.backend or "sim"
    if backend == "sglang":
        bad(
            "--backend sglang: the SGLang backend is not part of this release; "
            "use --backend sim (the simulated engine)"
        )
    if a.backend is None and gpu_visible():
        log.warning("a GPU is visible but --backend sglang is not available; using the simulator")
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
        dp=a.dp,
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
        startup_timeout_s=a.startup_timeout,
    )


def local_policy_opts(cfg: LaunchConfig, tenants: TenantTable | None) -> dict[str, Any]:
    """The local policy's options, with tenant weights where the policy takes weights."""
    opts = dict(cfg.schedule_policy_opts)
    if tenants is not None and tenants.weights and "weights" not in opts:
        cls = policy_class(cfg.schedule_policy)
        fields_ = getattr(cls.Config, "__dataclass_fields__", {})
        if "weights" in fields_:
            opts["weights"] = dict(tenants.weights)
    return opts


class ProcessGroup:
    """The worker processes: start them, watch them, stop them (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.Process] = []

    def start(self, configs: Sequence[Any]) -> None:
        from sgl_fair.worker.live import worker_main

        ctx = multiprocessing.get_context("spawn")
        for wcfg in configs:
            proc = ctx.Process(target=worker_main, args=(wcfg,), name=f"sgl-fair-worker-{wcfg.wid}")
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
    from sgl_fair.router.tokenizer import load_tokenizer

    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        tokenizer = load_tokenizer(cfg.model_path)
    except ValueError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2
    tenants = load_tenants(cfg.tenants) if cfg.tenants else None
    if cfg.port and not port_free(cfg.host, cfg.port):
        print(f"launch: error: --port {cfg.port} is already in use on {cfg.host}", file=sys.stderr)
        return 2
    ipc_dir = tempfile.mkdtemp(prefix="sgl-fair-")
    state = ServerState.create(cfg, tokenizer=tokenizer, tenants=tenants, ipc_dir=ipc_dir)
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

    async def on_shutdown() -> None:
        await state.service.close()
        await asyncio.get_running_loop().run_in_executor(None, procs.stop)

    app = build_app(state, on_shutdown=on_shutdown)
    server = Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            http="httptools",
            lifespan="on",
            log_level=cfg.log_level,
            access_log=cfg.log_level == "debug",
            timeout_graceful_shutdown=5,
        )
    )

    async def run() -> int:
        # Workers first, outside uvicorn: a start-up failure is one line, not a traceback.
        await state.service.start()
        procs.start(state.worker_configs())
        for i, proc in enumerate(procs.procs):
            state.service.watch_process(i, proc)
        try:
            await state.service.wait_ready(cfg.startup_timeout_s)
        except (TimeoutError, RuntimeError) as e:
            print(f"launch: error: {e}", file=sys.stderr)
            await state.service.close()
            return 1
        await server.serve()
        return 0 if server.started else 1

    try:
        runner = getattr(uvloop, "run", None) if uvloop is not None else None
        return runner(run()) if runner is not None else asyncio.run(run())
    finally:
        procs.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
