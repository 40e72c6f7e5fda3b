"""Run the server: router process (uvicorn + router service) and the worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from sgl_fair.config import load_tenants
from sgl_fair.launch.config import LaunchConfig, local_policy_opts, parse_config, share_guard_on
from sgl_fair.launch.http_protocol import connection_options
from sgl_fair.launch.ports import connection_budget, port_free, raise_fd_limit
from sgl_fair.launch.sglang import (
    bridge_configs,
    probe_servers,
    server_kv_endpoint,
    server_url,
    sglang_servers,
    startup_error,
)
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sglang.servers import WatchedWorker
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.text import TextModel

log = logging.getLogger("sgl_fair.launch")

# ---- processes ---------------------------------------------------------------------------------


class ProcessGroup:
    """The worker processes: start them, watch them, stop them (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.Process] = []
        self._configs: list[Any] = []
        self._target: Any = None
        self._stopping = False

    def start(self, configs: Sequence[Any], target: Any = None) -> None:
        """One process per config running ``target(config)`` (default: a simulated worker)."""
        if target is None:
            from sgl_fair.worker.live import worker_main as target

        self._target = target
        for wcfg in configs:
            self._configs.append(wcfg)
            self.procs.append(self._spawn(wcfg))

    def _spawn(self, wcfg: Any) -> multiprocessing.Process:
        ctx = multiprocessing.get_context("spawn")
        name = f"sgl-fair-worker-{wcfg.wid}"
        proc = ctx.Process(target=self._target, args=(wcfg,), name=name)
        proc.daemon = True
        proc.start()
        return proc

    def restart(self, i: int) -> multiprocessing.Process:
        """Start worker ``i`` again (its process exited); returns the new process. The router
        service calls this, with backoff, when it sees the old one gone."""
        if self._stopping:
            raise RuntimeError("the launcher is stopping")
        old = self.procs[i]
        old.join(0.1)  # reap it
        self.procs[i] = self._spawn(self._configs[i])
        log.warning("worker %d restarted (pid %s)", i, self.procs[i].pid)
        return self.procs[i]

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
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


def sim_worker_configs(cfg: LaunchConfig, state: Any) -> list[Any]:
    """One ``LiveWorkerConfig`` per in-process worker (``--backend sim`` or ``torch``)."""
    from sgl_fair.worker.live import LiveWorkerConfig

    torch_opts: dict[str, Any] = {}
    if cfg.backend == "torch":
        torch_opts = dict(
            backend="torch",
            vocab_size=state.tokenizer.vocab_size,
            torch_dtype=cfg.torch_dtype,
            torch_device=cfg.torch_device,
            torch_attention=cfg.torch_attention,
            # the workers share the host's cores
            torch_threads=max(1, (os.cpu_count() or 1) // cfg.dp),
        )
    torch_opts["kv_allocator"] = cfg.kv_allocator  # the sim's scheduler runs on it too
    torch_opts["kv_allocator_opts"] = dict(cfg.kv_allocator_opts)

    sched = SchedulerConfig(
        max_running_requests=cfg.max_running_requests,
        chunked_prefill_size=cfg.chunked_prefill_size,
        share_guard=share_guard_on(cfg),
    )
    opts = local_policy_opts(cfg, state.tenants)
    return [
        LiveWorkerConfig(
            wid=i,
            endpoints=state.service.endpoints.base,
            policy=cfg.schedule_policy,
            policy_opts=opts,
            gpu=cfg.gpu,
            model=cfg.model,
            tp=cfg.tp,
            kv_tokens=torch_kv_tokens(cfg) if cfg.backend == "torch" else cfg.kv_tokens,
            scheduler=sched,
            time_scale=cfg.time_scale,
            token_range=state.tokenizer.output_token_range,
            kv_page_size=cfg.kv_page_size,
            log_level=cfg.log_level,
            eos_lengths=cfg.sim_eos,
            eos_token_id=state.tokenizer.eos_token_id,
            text=text_model(state.tokenizer) if cfg.sim_text else None,
            **torch_opts,
        )
        for i in range(cfg.dp)
    ]


def torch_context_len(model: str) -> int:
    """A checkpoint's ``max_position_embeddings`` (the tiny preset: 8192)."""
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        import json

        with open(path) as f:
            return int(json.load(f).get("max_position_embeddings", 8192))
    return 8192


def torch_kv_tokens(cfg: LaunchConfig) -> int:
    """The torch workers' KV pool (tokens): --kv-tokens, else the worker's default."""
    from sgl_fair.worker.live import TORCH_DEFAULT_KV_TOKENS

    return cfg.kv_tokens or TORCH_DEFAULT_KV_TOKENS


def text_model(tokenizer: Any) -> TextModel:
    """The simulated model's punctuation, in the server tokenizer's ids (a mark that is not
    one token in this vocabulary is left out)."""

    def one_id(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return TextModel(period_id=one_id("."), comma_id=one_id(","), newline_id=one_id("\n"))


def serve(cfg: LaunchConfig, *, ready_file: str | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    raise_fd_limit()  # every connection holds a socket; a burst holds thousands

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
        urls = [server_url(s.argv) for s in servers.servers]
        kv_endpoints = [server_kv_endpoint(s.argv) for s in servers.servers]
    if sglang and kv_endpoints is None:
        log.warning("no --worker-kv-endpoint: the router tracks the servers' caches by guess")
    ipc_dir = tempfile.mkdtemp(prefix="sgl-fair-")
    # The sim model's numbers; a real engine's replace them (ServerState.adopt_engine_limits).
    if cfg.backend == "torch":  # the workers' pools; a preset's 8192 positions at most
        kv_cap = torch_kv_tokens(cfg)
        context_len = min(cfg.context_length or torch_context_len(cfg.model), kv_cap)
    else:
        cost = CostModel.from_names(cfg.gpu, cfg.model, tp=cfg.tp if not sglang else None)
        kv_cap = cfg.kv_tokens if cfg.kv_tokens is not None else cost.kv_capacity_tokens()
        context_len = cfg.context_length or cost.model.context_len
    state = ServerState.create(
        cfg,
        tokenizer=tokenizer,
        tenants=tenants,
        ipc_dir=ipc_dir,
        kv_capacity_tokens=kv_cap,
        context_len=context_len,
        kv_endpoints=kv_endpoints,
        worker_urls=urls,
        follow_kv_events=not sglang or kv_endpoints is not None,
    )
    procs = ProcessGroup()

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
            bridges = bridge_configs(cfg, state.service.endpoints.base, urls, pids, tenants)
            procs.start(bridges, bridge_main)
        else:
            procs.start(sim_worker_configs(cfg, state))
            # A simulated worker that exits is started again (an SGLang server is not: its
            # start takes minutes and its failure usually needs an operator).
            if cfg.worker_restart_backoff_s > 0:
                state.service.restarter = procs.restart
                state.service.restart_backoff_s = (cfg.worker_restart_backoff_s, 30.0)
        for i, proc in enumerate(procs.procs):
            watched = proc if servers is None else WatchedWorker(proc, servers.servers[i])
            state.service.watch_process(i, watched)
        try:
            await state.service.wait_ready(cfg.startup_timeout_s)
        except (TimeoutError, RuntimeError) as e:
            print(f"launch: error: {startup_error(e, servers)}", file=sys.stderr)
            await state.service.close()
            return 1
        if sglang:
            infos = await probe_servers(urls, cfg.worker_api_key)
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


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return serve(cfg)
    return 0
