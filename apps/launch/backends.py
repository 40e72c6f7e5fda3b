"""The engines the launcher can put behind the router, one :class:`Backend` object each.

A backend says, in one place, what the launcher must know about its engine: its own flags
and their defaults, its checks of the command line, the numbers the router starts from
before the workers report theirs, how its workers are started (:meth:`Backend.workers`, a
:class:`~sgl_fair.launch.workers.Workers`), and what the HTTP protocol may pass to its engine
(:attr:`Backend.features`). The launcher asks these; it never compares a backend's name.
``BACKENDS`` is the registry; ``--backend NAME`` looks a backend up there::

    sim      simulated GPUs: one worker process each (scheduler + cost model, wall clock)
    torch    a Llama model in plain torch in each worker process (--model tiny or a checkpoint)
    sglang   real SGLang servers (started here, or --worker-url), one bridge process each

A new kind (say, workers already running elsewhere that the router reaches over zmq) is one
more subclass here and its :class:`Workers`; nothing else in the launcher changes.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from sgl_fair.config import TenantTable
from sgl_fair.policies import policy_class, policy_names
from sgl_fair.router.protocol import EngineFeatures
from sgl_fair.worker.sglang.settings import batch_selecting
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.hardware import MODELS, get_model

if TYPE_CHECKING:
    from sgl_fair.launch.config import LaunchConfig
    from sgl_fair.launch.workers import Workers

log = logging.getLogger("sgl_fair.launch")

Bad = Callable[[str], None]  # the parser's error: one line naming the flag, exit 2

TORCH_PRESETS = ("tiny",)  # worker/torch_engine/model.py's PRESETS (checked by its tests)


class Backend:
    """One engine kind: its flags, checks, start-up numbers, workers and protocol features."""

    name: ClassVar[str]
    default_model: ClassVar[str] = "Llama-3.1-8B"
    # Its own flags and their defaults; given with another backend they are an error.
    own_flags: ClassVar[Mapping[str, Any]] = {}
    # Flags whose default depends on the engine; None leaves the engine's own choice.
    defaults: ClassVar[Mapping[str, int | None]] = {
        "chunked_prefill_size": 8192,
        "max_running_requests": 256,
    }
    startup_timeout_s: ClassVar[float] = 120.0  # default --startup-timeout
    # What the HTTP protocol may pass to the engine (router/protocol: EngineFeatures).
    features: ClassVar[EngineFeatures] = EngineFeatures()
    kv_allocator: ClassVar[bool] = True  # our KV allocator runs in its workers (--kv-allocator)
    simulated: ClassVar[bool] = False  # a simulated engine (the default when none is named)
    # Its workers are SGLang servers: SGLang's own flags (unknown ones, --api-key,
    # --schedule-low-priority-values-first) mean something to them.
    sglang_servers: ClassVar[bool] = False
    # Its workers can be shared by several routers (``replica_workers``), so
    # ``--router-replicas`` can start them once and put several routers over them.
    replicable: ClassVar[bool] = True
    # Its workers report the service every router dispatched to them (``ServiceReport`` with
    # each ``Load``), so router replicas over them can share one fairness state
    # (``--replica-state shared``; docs/replicas.md).
    reports_service: ClassVar[bool] = False
    # ... but only when asked, at a cost to them (SGLang's plugin: its ledger in the
    # scheduler's state, read through ``/server_info`` by each bridge): only a router that
    # is one of several replicas (``--tenant-limits-split`` > 1, which ``--router-replicas``
    # sets) asks, so a single router over them costs them nothing.
    service_on_request: ClassVar[bool] = False
    # Flags of our own engine and scheduler that this backend's workers never read: given
    # with it, they are an error naming the flag (else accepted and silently ignored).
    ignores: ClassVar[tuple[str, ...]] = ()

    def implied_by(self, a: argparse.Namespace) -> bool:
        """Whether flags given without ``--backend`` name this backend."""
        return False

    def check(self, a: argparse.Namespace, passthrough: Sequence[str], bad: Bad) -> int:
        """Its flags' checks (``passthrough``: flags the parser does not know); returns dp."""
        if passthrough:
            bad("unrecognized arguments: " + " ".join(passthrough))
        if a.worker_url or a.worker_kv_endpoint:
            bad("--worker-url / --worker-kv-endpoint need --backend sglang")
        if a.worker_endpoint or a.worker_endpoints_file or a.worker_discovery_k8s:
            bad(f"--worker-endpoint: standalone workers are --backend remote (not {self.name})")
        return 1 if a.dp is None else a.dp

    def check_model(self, a: argparse.Namespace, bad: Bad) -> None:
        """``--model`` / ``--gpu`` / ``--tp``: the simulator's catalogue (its numbers are the
        router's until the workers report theirs)."""
        try:
            get_model(a.model)
        except (KeyError, ValueError):
            bad(f"--model {a.model!r} is unknown; choose from {sorted(MODELS)}")
        try:
            CostModel.from_names(a.gpu, a.model, tp=self.cost_tp(a.tp))
        except ValueError as e:
            bad(f"--gpu/--model/--tp: {e}")

    def cost_tp(self, tp: int | None) -> int | None:
        """The tensor parallelism the simulator's cost model is built with."""
        return tp

    def server_args(self, a: argparse.Namespace, passthrough: Sequence[str]) -> tuple[str, ...]:
        """Flags passed on to every engine server the launcher starts."""
        return tuple(passthrough)

    def launch_limits(self, cfg: LaunchConfig) -> tuple[int, int]:
        """One worker's KV pool (tokens) and the model's context, as known before the workers
        start (a real engine's numbers replace them: ``Workers.ready``)."""
        cost = CostModel.from_names(cfg.gpu, cfg.model, tp=self.cost_tp(cfg.tp))
        kv_cap = cfg.kv_tokens if cfg.kv_tokens is not None else cost.kv_capacity_tokens()
        return kv_cap, cfg.context_length or cost.model.context_len

    def tokenizer_error(self, cfg: LaunchConfig, builtin: bool) -> str | None:
        """Why the router's tokenizer does not do for this engine (``builtin``: no model
        directory, the built-in tokenizer); None: it does."""
        return None

    def worker_options(self, cfg: LaunchConfig, tokenizer: Any) -> dict[str, Any]:
        """What this engine adds to each in-process worker's ``LiveWorkerConfig``."""
        return {"kv_tokens": cfg.kv_tokens}

    def workers(self, cfg: LaunchConfig, tenants: TenantTable | None) -> Workers:
        """The worker processes of one launch (started by ``serve``)."""
        from sgl_fair.launch.workers import LocalWorkers

        return LocalWorkers(cfg, self)

    def replica_workers(self, cfg: LaunchConfig, avoid: set[int]) -> Any:
        """``--router-replicas``: the workers started once for every replica (a
        ``replicas.ReplicaWorkers``; ``avoid``: ports the replicas take). Here: standalone
        ``python -m sgl_fair.worker`` processes on loopback."""
        from sgl_fair.launch.replicas import StandaloneWorkers

        return StandaloneWorkers(cfg, avoid)

    def engine_label(self, state: Any) -> str:
        """The engine, as the ``ready`` line names it."""
        cfg = state.cfg
        speed = "zero-cost" if math.isinf(cfg.time_scale) else f"time-scale {cfg.time_scale:g}"
        return f"{cfg.backend} {cfg.gpu} {cfg.model} ({speed})"


class SimBackend(Backend):
    name = "sim"
    simulated = True
    features = EngineFeatures(simulated=True)


class TorchBackend(Backend):
    name = "torch"
    default_model = "tiny"
    own_flags = {"torch_dtype": "float32", "torch_device": "cpu", "torch_attention": "reference"}

    def check(self, a: argparse.Namespace, passthrough: Sequence[str], bad: Bad) -> int:
        """The --backend torch flags' checks (torch itself is imported by the workers only)."""
        if importlib.util.find_spec("torch") is None:
            bad("--backend torch needs torch (pip install -e '.[kernels]')")
        if a.model not in TORCH_PRESETS and not os.path.isdir(a.model):
            bad(
                f"--model {a.model!r}: --backend torch takes {', '.join(TORCH_PRESETS)} or a "
                "local Hugging Face Llama checkpoint directory (config.json + *.safetensors)"
            )
        if a.tp not in (None, 1):
            bad("--backend torch runs one device per worker (no --tp)")
        if a.torch_attention == "triton" and not a.torch_device.startswith("cuda"):
            bad("--torch-attention triton needs --torch-device cuda")
        if a.model_path is None and os.path.isdir(a.model):
            a.model_path = a.model  # the checkpoint's own tokenizer
        return super().check(a, passthrough, bad)

    def check_model(self, a: argparse.Namespace, bad: Bad) -> None:
        pass  # checked in ``check``: a preset or a checkpoint directory

    def launch_limits(self, cfg: LaunchConfig) -> tuple[int, int]:
        """The workers' pools; a preset's 8192 positions at most."""
        kv_cap = torch_kv_tokens(cfg)
        return kv_cap, min(cfg.context_length or torch_context_len(cfg.model), kv_cap)

    def worker_options(self, cfg: LaunchConfig, tokenizer: Any) -> dict[str, Any]:
        return dict(
            backend="torch",
            vocab_size=tokenizer.vocab_size,
            torch_dtype=cfg.torch_dtype,
            torch_device=cfg.torch_device,
            torch_attention=cfg.torch_attention,
            # the workers share the host's cores
            torch_threads=max(1, (os.cpu_count() or 1) // cfg.dp),
            kv_tokens=torch_kv_tokens(cfg),
        )


HTTP_URL = re.compile(r"https?://[^/\s]+(/\S*)?")


def public_ip(endpoint: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint is public: an IP address that is, or a host
    name whose every address is (resolved now; a name that does not resolve is taken, as one
    the launcher's machine cannot judge, e.g. a name only the pods' network knows)."""
    import ipaddress
    import socket

    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    return bool(addresses) and all(a.is_global for a in addresses)


def _check_discovery(a: argparse.Namespace, bad: Bad) -> None:
    """``--worker-discovery-k8s`` and its ``--k8s-*`` flags."""
    if not a.worker_discovery_k8s.strip():
        bad("--worker-discovery-k8s: give a label selector, e.g. app=sgl-fair-worker")
    if not a.k8s_period_s > 0:
        bad(f"--k8s-period-s must be > 0 (got {a.k8s_period_s})")
    if a.k8s_token_file is not None and not os.path.isfile(a.k8s_token_file):
        bad(f"--k8s-token-file {a.k8s_token_file}: no such file")
    from sgl_fair.router.discovery_k8s import DiscoveryError, KubeAPI

    try:  # in a pod these come from its service account; else they must be given
        KubeAPI.from_env(a.k8s_api, a.k8s_namespace, a.k8s_token_file)
    except DiscoveryError as e:
        bad(str(e))


class SGLangBackend(Backend):
    name = "sglang"
    # None: SGLang sizes both per GPU; the launcher passes them only when the user gave them
    defaults = {"chunked_prefill_size": None, "max_running_requests": None}
    startup_timeout_s = 900.0  # loading a model takes minutes
    features = EngineFeatures(passthrough=True)
    kv_allocator = False
    sglang_servers = True
    reports_service = True  # the plugin's service ledger (worker/sglang/ledger.py)
    service_on_request = True
    # SGLang's own scheduler and model run the requests: no simulated GPU, clock or EOS (the
    # share guard runs through SGLang's priority preemption: worker/sglang/share_preempt.py)
    ignores = ("gpu", "time_scale", "sim_eos")

    def implied_by(self, a: argparse.Namespace) -> bool:
        return bool(a.worker_url)

    def check(self, a: argparse.Namespace, passthrough: Sequence[str], bad: Bad) -> int:
        """The --backend sglang flags' checks; returns dp (the number of --worker-url if
        given)."""
        urls, kv = a.worker_url, a.worker_kv_endpoint
        if a.worker_discovery_k8s is not None:  # running servers, found as pods: none started
            if urls:  # (--model-path is then the router's tokenizer only)
                bad("--worker-discovery-k8s finds the SGLang servers: not with --worker-url")
            _check_discovery(a, bad)
            return 1
        if not urls:
            if kv or a.worker_kv_replay_endpoint:
                bad("--worker-kv-endpoint needs --worker-url (the servers it belongs to)")
            policy = a.schedule_policy
            if policy in policy_names() and batch_selecting(policy_class(policy)):
                bad(
                    f"--schedule-policy {policy} chooses whole running batches, which "
                    "SGLang's scheduler does not let our plugin do; use --backend sim or torch"
                )
            if not a.model_path:
                bad(
                    "--backend sglang needs --model-path (the model each SGLang server loads) "
                    "or --worker-url (SGLang servers already running)"
                )
            return 1 if a.dp is None else a.dp
        if a.dp is not None and a.dp != len(urls):
            bad(f"--dp {a.dp} does not match the {len(urls)} --worker-url given (one per worker)")
        for url in urls:
            if not HTTP_URL.fullmatch(url):
                bad(f"--worker-url {url!r} is not an http:// or https:// URL")
        if kv and len(kv) != len(urls):
            bad(
                f"--worker-kv-endpoint given {len(kv)} times for {len(urls)} --worker-url; "
                "give one per URL, in the same order, or none"
            )
        for ep in kv:
            if not ep.startswith(("tcp://", "ipc://")):
                bad(f"--worker-kv-endpoint {ep!r} is not a zmq tcp:// or ipc:// endpoint")
            if public_ip(ep):
                bad(
                    f"--worker-kv-endpoint {ep}: a public address, and SGLang's KV events are "
                    "plaintext zmq anyone there can publish to or read; publish them on "
                    "loopback or a private network (docs/operators.md)"
                )
        replay = a.worker_kv_replay_endpoint
        if replay and len(replay) != len(kv):
            bad(
                f"--worker-kv-replay-endpoint given {len(replay)} times for {len(kv)} "
                "--worker-kv-endpoint; give one per KV endpoint, in the same order, or none"
            )
        for ep in replay:
            if not ep.startswith(("tcp://", "ipc://")):
                bad(f"--worker-kv-replay-endpoint {ep!r} is not a zmq tcp:// or ipc:// endpoint")
        if passthrough:
            bad(
                f"{' '.join(passthrough)}: unknown flags go to the SGLang servers the launcher "
                "starts; with --worker-url it starts none"
            )
        return len(urls)

    def cost_tp(self, tp: int | None) -> int | None:
        return None  # the servers' own; the sim's numbers only stand in until they report

    def replica_workers(self, cfg: LaunchConfig, avoid: set[int]) -> Any:
        """The SGLang servers (started here, or the ``--worker-url`` ones) that every
        replica's bridges reach."""
        from sgl_fair.launch.sglang import SharedServers

        return SharedServers(cfg, avoid)

    def server_args(self, a: argparse.Namespace, passthrough: Sequence[str]) -> tuple[str, ...]:
        # SGLang's own flag: the servers the launcher starts get it too
        low_first = a.schedule_low_priority_values_first and not a.worker_url
        return tuple(passthrough) + (("--schedule-low-priority-values-first",) if low_first else ())

    def tokenizer_error(self, cfg: LaunchConfig, builtin: bool) -> str | None:
        if builtin and not cfg.worker_urls and not cfg.worker_discovery_k8s:
            return (
                f"--model-path {cfg.model_path!r}: --backend sglang needs a local model "
                "directory (the router tokenizes prompts with its tokenizer.json); download "
                "the model first"
            )
        if builtin:
            log.warning("no --model-path: prompts are tokenized with the built-in tokenizer")
        return None

    def workers(self, cfg: LaunchConfig, tenants: TenantTable | None) -> Workers:
        from sgl_fair.launch.sglang import SGLangWorkers

        return SGLangWorkers(cfg, tenants)

    def engine_label(self, state: Any) -> str:
        engines = sorted({w.engine for w in state.service.workers.values() if w.engine})
        return ", ".join(engines) or "sglang"


class RemoteBackend(Backend):
    """Standalone workers elsewhere (``--worker-endpoint``, implied by it): this process is a
    router only. Their engine's numbers come with their Hello (``Workers.ready``)."""

    name = "remote"
    replicable = False  # it starts no workers to share
    reports_service = True  # standalone workers (python -m sgl_fair.worker --bind)

    def implied_by(self, a: argparse.Namespace) -> bool:
        return bool(a.worker_endpoint or a.worker_endpoints_file or a.worker_discovery_k8s)

    def check(self, a: argparse.Namespace, passthrough: Sequence[str], bad: Bad) -> int:
        from sgl_fair.remote import is_loopback, parse_tcp

        if passthrough:
            bad("unrecognized arguments: " + " ".join(passthrough))
        if not a.worker_endpoint and not a.worker_endpoints_file and not a.worker_discovery_k8s:
            bad("--backend remote needs --worker-endpoint tcp://HOST:PORT (one per worker)")
        if a.worker_discovery_k8s is not None:
            _check_discovery(a, bad)
        if a.worker_endpoints_file and not os.path.isfile(a.worker_endpoints_file):
            bad(f"--worker-endpoints-file {a.worker_endpoints_file}: no such file")
        if a.worker_url or a.worker_kv_endpoint:
            bad("--worker-url / --worker-kv-endpoint (SGLang servers): not with --worker-endpoint")
        for ep in a.worker_endpoint:
            try:
                host, _ = parse_tcp(ep, "--worker-endpoint")
            except ValueError as e:
                bad(str(e))
            if not is_loopback(host) and not a.worker_keys and not a.insecure:
                bad(f"--worker-endpoint {ep}: not a loopback address; give --worker-keys DIR "
                    "(CURVE) or --insecure")  # fmt: skip
        if len(set(a.worker_endpoint)) != len(a.worker_endpoint):
            bad("--worker-endpoint: an endpoint is given twice")
        if a.worker_endpoints_file or a.worker_discovery_k8s:
            return max(1, len(a.worker_endpoint))  # the file's / the pods' come and go
        if a.dp is not None and a.dp != len(a.worker_endpoint):
            bad(f"--dp {a.dp} does not match the {len(a.worker_endpoint)} --worker-endpoint given")
        return len(a.worker_endpoint)

    def check_model(self, a: argparse.Namespace, bad: Bad) -> None:
        pass  # the workers run their own engine and model

    def launch_limits(self, cfg: LaunchConfig) -> tuple[int, int]:
        """The simulator's numbers for ``--model`` when it knows it, else a torch worker's
        defaults (its pool, a preset's positions) until the workers report."""
        try:
            return super().launch_limits(cfg)
        except (KeyError, ValueError):
            return cfg.kv_tokens or torch_kv_tokens(cfg), cfg.context_length or 8192

    def workers(self, cfg: LaunchConfig, tenants: TenantTable | None) -> Workers:
        from sgl_fair.launch.workers import RemoteWorkers

        return RemoteWorkers(cfg)

    def engine_label(self, state: Any) -> str:
        engines = sorted({w.engine for w in state.service.workers.values() if w.engine})
        return ", ".join(engines) or "remote"


BACKENDS: dict[str, Backend] = {
    b.name: b for b in (SimBackend(), TorchBackend(), SGLangBackend(), RemoteBackend())
}
DEFAULT_BACKEND = "sim"


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend_of(name: str) -> Backend:
    """The backend ``--backend NAME`` names (``LaunchConfig.backend``)."""
    return BACKENDS[name]


def chosen_backend(a: argparse.Namespace) -> Backend:
    """``--backend``, else the one the flags given imply (``--worker-url``: sglang), else
    the default (sim)."""
    if a.backend is not None:
        return BACKENDS[a.backend]
    implied = [b for b in BACKENDS.values() if b.implied_by(a)]
    return implied[0] if implied else BACKENDS[DEFAULT_BACKEND]


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
