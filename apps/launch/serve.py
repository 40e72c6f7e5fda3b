"""Run the server: router process (uvicorn + router service) and the worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from sgl_fair.config import load_tenants
from sgl_fair.launch.backends import backend_of
from sgl_fair.launch.config import LaunchConfig, parse_config
from sgl_fair.launch.http_protocol import connection_options
from sgl_fair.launch.ports import connection_budget, port_free, raise_fd_limit
from sgl_fair.launch.replicas import client_keys, serve_replicas, split_limits
from sgl_fair.launch.workers import ProcessGroup, sim_worker_configs, text_model

__all__ = ["ProcessGroup", "main", "serve", "sim_worker_configs", "text_model"]

log = logging.getLogger("sgl_fair.launch")


def serve(cfg: LaunchConfig, *, ready_file: str | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    raise_fd_limit()  # every connection holds a socket; a burst holds thousands

    try:
        import uvloop
    except ImportError:  # uvloop is optional (not on Windows): plain asyncio then
        uvloop = None

    from sgl_fair.router.membership import Membership
    from sgl_fair.router.server import ServerState, build_app
    from sgl_fair.router.tokenizer import BuiltinTokenizer, load_tokenizer

    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    backend = backend_of(cfg.backend)
    try:
        tokenizer = load_tokenizer(cfg.model_path)
    except ValueError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2
    why = backend.tokenizer_error(cfg, isinstance(tokenizer, BuiltinTokenizer))
    if why is not None:
        print(f"launch: error: {why}", file=sys.stderr)
        return 2
    tenants = load_tenants(cfg.tenants) if cfg.tenants else None
    if tenants is not None:  # one of R replicas: 1/R of each cluster-wide limit
        tenants = split_limits(tenants, cfg.tenant_limits_split)
    if cfg.port and not port_free(cfg.host, cfg.port):
        print(f"launch: error: --port {cfg.port} is already in use on {cfg.host}", file=sys.stderr)
        return 2
    workers = backend.workers(cfg, tenants)
    ipc_dir = tempfile.mkdtemp(prefix="sgl-fair-")
    # The sim model's numbers; a real engine's replace them (Workers.ready).
    kv_cap, context_len = backend.launch_limits(cfg)
    state = ServerState.create(
        cfg,
        tokenizer=tokenizer,
        tenants=tenants,
        ipc_dir=ipc_dir,
        kv_capacity_tokens=kv_cap,
        context_len=context_len,
        kv_endpoints=workers.kv_endpoints,
        kv_replay_endpoints=workers.kv_replay_endpoints,
        worker_urls=workers.urls,
        follow_kv_events=workers.follow_kv_events,
        features=backend.features,
        local_workers=workers.local_workers,
    )

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            """uvicorn's, less its re-raise of the captured signal after the graceful
            shutdown: a re-raised SIGTERM killed the launcher (status 143) before its
            clean-up (the socket folder) ran. SIGTERM now ends it as Ctrl-C does."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else cfg.port
                url = f"http://{cfg.host}:{port}"
                state.url = url
                engine = backend.engine_label(state)
                print(f"sgl-fair ready at {url}  ({state.describe(engine)})", flush=True)
                if ready_file:
                    with open(ready_file, "w") as f:
                        f.write(url)

    async def on_shutdown() -> None:
        await state.membership.close()
        await state.service.close()
        await asyncio.get_running_loop().run_in_executor(None, workers.stop)

    async def run() -> int:
        # Workers first, outside uvicorn: a start-up failure is one line, not a traceback.
        await state.service.start()
        state.membership = Membership(
            state.service, name=f"{cfg.host}:{cfg.port}", keys=client_keys(cfg),
            server_link=workers.server_links(state), insecure=cfg.insecure,
        )  # fmt: skip
        state.membership.start()
        state.telemetry.replicas.membership = state.membership  # on /metrics
        workers.start(state)
        try:
            await state.service.wait_ready(cfg.startup_timeout_s, cfg.min_ready_workers)
        except (TimeoutError, RuntimeError) as e:
            print(f"launch: error: {workers.startup_error(e)}", file=sys.stderr)
            await state.service.close()
            return 1
        missing = [w.wid for w in state.service.workers.values() if not w.ever_ready]
        if missing:
            print(f"launch: serving with {len(state.service.workers) - len(missing)} of "
                  f"{len(state.service.workers)} workers; workers {missing} join when they "
                  "say Hello", file=sys.stderr, flush=True)  # fmt: skip
        await workers.ready(state)
        server = Server(
            uvicorn.Config(
                build_app(state, on_shutdown=on_shutdown),
                host=cfg.host,
                port=cfg.port,
                **connection_options(
                    header_timeout_s=cfg.http_header_timeout_s,
                    max_connections=cfg.max_connections or connection_budget(),
                ),
                lifespan="on",
                log_level=cfg.log_level,
                access_log=cfg.log_level == "debug",
                timeout_graceful_shutdown=5,
            )
        )
        await server.serve()
        return 0 if server.started else 1

    workers.start_servers()  # before any thread exists (engine servers are forked)
    try:
        runner = getattr(uvloop, "run", None) if uvloop is not None else None
        return runner(run()) if runner is not None else asyncio.run(run())
    finally:
        workers.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    run = serve_replicas if cfg.router_replicas is not None else serve  # --router-replicas
    with contextlib.suppress(KeyboardInterrupt):
        return run(cfg)
    return 0
