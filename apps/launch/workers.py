"""The worker processes of one launch: :class:`Workers` (what ``serve`` asks of them) and
:class:`LocalWorkers` (``--backend sim`` and ``torch``: one worker process per data-parallel
rank on this host, restarted when it exits). ``sglang.SGLangWorkers`` is the SGLang kind.

``serve`` drives every kind the same way::

    workers = backend.workers(cfg, tenants)   # what to start; urls / KV-event endpoints
    workers.start_servers()                   # before any thread: engine servers (forked)
    workers.start(state)                      # once the router's sockets are bound
    await state.service.wait_ready(...)       # (workers.startup_error(e) if that fails)
    await workers.ready(state)                # the engines' own numbers replace the sim's
    workers.stop()                            # at the end, whatever happened
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sgl_fair.launch.config import LaunchConfig, local_policy_opts, share_guard_on
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.sim.text import TextModel

if TYPE_CHECKING:
    from sgl_fair.launch.backends import Backend

log = logging.getLogger("sgl_fair.launch")


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


class Workers:
    """One launch's workers, as ``serve`` starts, watches and stops them."""

    urls: list[str]  # each worker's engine server (shown in /server_info); [] for none
    kv_endpoints: list[str] | None  # where each publishes KV events; None: the ipc default
    kv_replay_endpoints: list[str | None] | None  # where each replays missed KV events
    follow_kv_events: bool  # False: the router guesses the caches from what it routed
    local_workers: int | None = None  # on this host's ipc sockets (None: all dp of them)

    def __init__(self) -> None:
        self.procs = ProcessGroup()
        self.urls = []
        self.kv_endpoints = None
        self.kv_replay_endpoints = None
        self.follow_kv_events = True

    def start_servers(self) -> None:
        """Start what must be forked before any thread exists (engine servers); nothing by
        default."""

    def start(self, state: Any) -> None:
        """Start the worker processes (the router's sockets are bound) and have the router
        service watch them."""
        raise NotImplementedError

    def watch(self, state: Any) -> None:
        for i, proc in enumerate(self.procs.procs):
            state.service.watch_process(i, proc)

    async def ready(self, state: Any) -> None:
        """Every worker has said hello: take what the engines report (nothing by default)."""

    def startup_error(self, e: Exception) -> str:
        """The one line for a start-up that failed with ``e``."""
        return str(e)

    def server_links(self, state: Any) -> Any:
        """What ``POST /workers {"url"}`` links an SGLang server with
        (``router/membership.py``'s ``server_link``); None: these workers are no servers."""
        return None

    def stop(self) -> None:
        self.procs.stop()


class LocalWorkers(Workers):
    """``--backend sim`` / ``torch``: one ``worker.live`` process per rank, on this host's zmq
    ipc sockets; a worker that exits is started again after ``--worker-restart-backoff``."""

    def __init__(self, cfg: LaunchConfig, backend: Backend) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend

    def start(self, state: Any) -> None:
        cfg = self.cfg
        self.procs.start(sim_worker_configs(cfg, state, self.backend))
        # A simulated worker that exits is started again (an SGLang server is not: its
        # start takes minutes and its failure usually needs an operator).
        if cfg.worker_restart_backoff_s > 0:
            state.service.restarter = self.procs.restart
            state.service.restart_backoff_s = (cfg.worker_restart_backoff_s, 30.0)
        self.watch(state)


class RemoteWorkers(Workers):
    """``--worker-endpoint``: standalone workers (``python -m sgl_fair.worker --bind``)
    elsewhere; the router links to each (``router/remote_link.py``) and starts nothing."""

    local_workers = 0

    def __init__(self, cfg: LaunchConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def start(self, state: Any) -> None:
        for endpoint in self.cfg.worker_endpoints:
            state.membership.add(endpoint)
        if self.cfg.worker_endpoints_file:
            state.membership.watch(self.cfg.worker_endpoints_file)
        if self.cfg.worker_discovery_k8s:
            state.membership.discover(k8s_discovery(self.cfg),
                                      port=self.cfg.k8s_port_name or "dispatch")  # fmt: skip
        router, members = state.service.router, state.service.workers
        for u in router.workers:  # the router's first ids that no worker took
            if u not in members:
                router.remove_worker(u)

    async def ready(self, state: Any) -> None:
        """Every worker said Hello: their KV pools and their models' context lengths (the
        shortest of each) replace the numbers the router started from."""
        contexts = [w.context_len for w in state.service.workers.values() if w.context_len]
        state.adopt_engine_limits(context_len=min(contexts) if contexts else None, model_name=None)

    def startup_error(self, e: Exception) -> str:
        return (f"{e}: is `python -m sgl_fair.worker --bind ...` running at "
                f"{', '.join(self.cfg.worker_endpoints)} (and --worker-keys right)?")  # fmt: skip


def k8s_discovery(cfg: LaunchConfig) -> Any:
    """``--worker-discovery-k8s``: the pods' lister (``router/discovery_k8s.py``); a missing
    piece of its configuration is a start-up error naming the flag."""
    from sgl_fair.router.discovery_k8s import KubeAPI, KubeDiscovery

    api = KubeAPI.from_env(cfg.k8s_api, cfg.k8s_namespace, cfg.k8s_token_file)
    return KubeDiscovery(
        api, cfg.worker_discovery_k8s or "", lambda found: None, period_s=cfg.k8s_period_s
    )


def sim_worker_configs(cfg: LaunchConfig, state: Any, backend: Backend | None = None) -> list[Any]:
    """One ``LiveWorkerConfig`` per in-process worker (``--backend sim`` or ``torch``)."""
    from sgl_fair.launch.backends import backend_of
    from sgl_fair.worker.live import LiveWorkerConfig

    backend = backend or backend_of(cfg.backend)
    engine_opts = backend.worker_options(cfg, state.tokenizer)
    engine_opts["kv_allocator"] = cfg.kv_allocator  # the sim's scheduler runs on it too
    engine_opts["kv_allocator_opts"] = dict(cfg.kv_allocator_opts)

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
            scheduler=sched,
            time_scale=cfg.time_scale,
            token_range=state.tokenizer.output_token_range,
            kv_page_size=cfg.kv_page_size,
            log_level=cfg.log_level,
            eos_lengths=cfg.sim_eos,
            eos_token_id=state.tokenizer.eos_token_id,
            text=text_model(state.tokenizer) if cfg.sim_text else None,
            **engine_opts,
        )
        for i in range(cfg.dp)
    ]


def text_model(tokenizer: Any) -> TextModel:
    """The simulated model's punctuation, in the server tokenizer's ids (a mark that is not
    one token in this vocabulary is left out)."""

    def one_id(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return TextModel(period_id=one_id("."), comma_id=one_id(","), newline_id=one_id("\n"))
