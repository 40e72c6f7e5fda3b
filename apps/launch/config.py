"""The launcher's flags: ``LaunchConfig`` and the parser (SGLang's ``ServerArgs`` names)."""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.config import ConfigError, TenantTable, load_tenants
from sgl_fair.launch.backends import BACKENDS, TORCH_PRESETS, chosen_backend
from sgl_fair.launch.flags import build_parser, gpu_visible
from sgl_fair.policies import PolicyTraits, make_policy, policy_class, policy_names
from sgl_fair.router.oit import SHARED_KEYS, ClusterOITConfig
from sgl_fair.router.policies import make_router_policy, router_policy_names
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.sim.hardware import GPUS, get_gpu
from sgl_fair.worker.sim.text import EosLengths

log = logging.getLogger("sgl_fair.launch")

# Flags of our simulated engine and scheduler (None in the parser, so "given" is known), and
# their defaults; a backend that never reads one declares it (``Backend.ignores``).
ENGINE_FLAGS = {"gpu": "H100-80GB", "time_scale": 1.0, "sim_eos": "192,0.9", "share_guard": "auto"}

__all__ = ["TORCH_PRESETS", "LaunchConfig", "cluster_oit_settings", "local_policy_opts",
           "parse_config", "share_guard_on"]  # fmt: skip


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
    cluster_oit: bool = False  # FairServe's OIT at the router, over the cluster (router/oit.py)
    cluster_oit_opts: dict[str, Any] = field(default_factory=dict)  # its options, resolved
    chunked_prefill_size: int | None = 8192  # None: the engine's own (SGLang's, per GPU)
    max_running_requests: int | None = 256
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
    worker_restart_backoff_s: float = 0.5  # first delay before restarting a dead worker; 0: never
    sim_eos: EosLengths | None = field(default_factory=EosLengths)  # None: run to max_new_tokens
    sim_text: bool = True  # punctuation and newlines in simulated output
    max_queued_requests: int | None = 4096  # generation requests served at once; more -> 429
    share_guard: str = "auto"  # auto: on for fair local policies (worker/share_guard.py)
    admin_key: str | None = None  # guards /metrics, /server_info, /flush_cache (see guard.py)
    admin_loopback: bool = True  # callers on 127.0.0.1/::1 need no admin key
    http_header_timeout_s: float = 10.0  # a connection's next request headers, or it closes
    max_connections: int | None = None  # None: the file limit less a reserve
    startup_timeout_s: float = 120.0
    # Serve once this many workers said Hello (None: every one); the rest join when they do.
    min_ready_workers: int | None = None
    max_tree_tokens: int | None = 4_000_000
    # --backend sglang
    worker_urls: tuple[str, ...] = ()  # servers already running (else the launcher starts dp)
    worker_kv_endpoints: tuple[str, ...] = ()
    worker_kv_replay_endpoints: tuple[str, ...] = ()  # each --worker-url's KV replay, if any
    sglang_args: tuple[str, ...] = ()  # passed through to every server the launcher starts
    worker_api_key: str | None = None  # the servers' --api-key (Bearer on every bridge call)
    bridges: str = "router"  # the bridges inside the router's process, or "process": one each
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 30.0
    # SGLang's integer `priority` sets a request's class when it names none: >= N is RT
    # (<= N with low_priority_values_first, SGLang's --schedule-low-priority-values-first).
    rt_priority_threshold: int | None = None
    low_priority_values_first: bool = False
    # --backend torch: a real model in plain torch (worker/torch_engine); `model` is a preset
    # ("tiny") or a local Hugging Face Llama checkpoint directory
    torch_dtype: str = "float32"
    torch_device: str = "cpu"
    torch_attention: str = "reference"
    kv_allocator: str = "token"
    kv_allocator_opts: dict[str, Any] = field(default_factory=dict)
    # many hosts (docs/operators.md): standalone workers, router replicas
    worker_endpoints: tuple[str, ...] = ()  # --backend remote: tcp://HOST:PORT each
    worker_endpoints_file: str | None = None  # watched: more endpoints, one a line
    # Kubernetes discovery (router/discovery_k8s.py): the ready pods of this label selector
    worker_discovery_k8s: str | None = None
    k8s_port_name: str | None = None  # None: dispatch (standalone workers), http (SGLang)
    k8s_namespace: str | None = None
    k8s_api: str | None = None
    k8s_token_file: str | None = None
    k8s_period_s: float = 2.0
    worker_keys: str | None = None  # CURVE keys folder (router.key_secret, worker.key)
    insecure: bool = False  # non-loopback workers without keys: plain text
    router_replicas: int | None = None  # start dp standalone workers and R routers over them
    replica_state: str = "shared"  # shared: fairness state through the workers' reports
    replica_id: int | None = None  # this router's id in those reports (None: a plain Router)
    tenant_limits_split: int = 1  # enforce 1/N of each tenant's max_inflight, rpm, burst


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
        # dotted keys set nested options: limits.user_limit=5 -> {"limits": {"user_limit": 5}}
        *parents, leaf = key.split(".")
        if not leaf or not all(parents):
            raise ValueError(f"{flag}: bad key {key!r}")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{flag}: {part} is given as a value and as options")
            node = child
        node[leaf] = value
    return out


def parse_config(argv: Sequence[str] | None = None) -> LaunchConfig:
    """The checked configuration; a bad flag is one line naming it (exit 2). What depends on
    the engine is the chosen backend's (``backends.py``)."""
    parser = build_parser()
    a, passthrough = parser.parse_known_args(argv)

    def bad(msg: str) -> None:
        parser.error(msg)  # exits 2 with the usage line and the message

    backend = chosen_backend(a)
    if a.model is None:
        a.model = backend.default_model
    for f, default in ENGINE_FLAGS.items():  # our engine's flags, given where none reads them
        if getattr(a, f) is not None and f in backend.ignores:
            bad(f"--{f.replace('_', '-')}: --backend {backend.name} does not use it (its "
                "servers run SGLang's own scheduler and model)")  # fmt: skip
        if getattr(a, f) is None:
            setattr(a, f, default)
    for other in BACKENDS.values():  # a backend's own flags, given with another
        given = [f"--{f.replace('_', '-')}" for f in other.own_flags if getattr(a, f) is not None]
        if given and other is not backend:
            bad(f"{', '.join(given)}: only with --backend {other.name}")
        for f, default in other.own_flags.items():
            if getattr(a, f) is None:
                setattr(a, f, default)
    if a.kv_allocator is None:
        if a.kv_allocator_opt and backend.kv_allocator:
            bad("--kv-allocator-opt: name the allocator with --kv-allocator")
        a.kv_allocator = "token"
    elif not backend.kv_allocator:
        bad("--kv-allocator: SGLang servers allocate their own KV (sim or torch backends only)")
    if a.kv_allocator_opt and not backend.kv_allocator:
        bad("--kv-allocator-opt: SGLang servers allocate their own KV (sim or torch backends only)")
    try:
        alloc_opts = _kv(a.kv_allocator_opt, "--kv-allocator-opt")
        make_allocator(a.kv_allocator, 4096, **alloc_opts)  # checks the options, names the bad one
    except ValueError as e:
        bad(f"--kv-allocator-opt: {e}")
    dp = backend.check(a, passthrough, bad)
    if dp < 1:
        bad(f"--dp must be >= 1 (got {dp})")
    if not 0 <= a.port <= 65535:
        bad(f"--port must be in 0..65535 (got {a.port})")
    if a.schedule_policy not in policy_names():
        bad(f"--schedule-policy {a.schedule_policy!r} is unknown; choose from {policy_names()}")
    if a.router_policy not in router_policy_names():
        bad(f"--router-policy {a.router_policy!r} is unknown; choose from {router_policy_names()}")
    for name, default in backend.defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    for name in ("chunked_prefill_size", "max_running_requests", "kv_page_size", "max_body_bytes"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            bad(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if not a.time_scale > 0:
        bad(f"--time-scale must be > 0 (got {a.time_scale})")
    if a.min_ready_workers is not None and not 1 <= a.min_ready_workers <= dp:
        bad(f"--min-ready-workers must be in 1..{dp} (got {a.min_ready_workers})")
    if not a.heartbeat_timeout > 0:
        bad(f"--heartbeat-timeout must be > 0 (got {a.heartbeat_timeout})")
    try:
        sim_eos = EosLengths.parse(a.sim_eos)
    except ValueError as e:
        bad(f"--sim-eos: {e}")
    if not 0 < a.http_header_timeout <= 3600:
        bad(f"--http-header-timeout must be in (0, 3600] s (got {a.http_header_timeout})")
    if a.max_connections is not None and a.max_connections < 1:
        bad(f"--max-connections must be >= 1 (got {a.max_connections})")
    if a.max_queued_requests < 0:
        bad(f"--max-queued-requests must be >= 0 (got {a.max_queued_requests})")
    if not 0 <= a.worker_restart_backoff <= 3600:
        bad(f"--worker-restart-backoff must be in 0..3600 s (got {a.worker_restart_backoff})")
    try:
        get_gpu(a.gpu)
    except (KeyError, ValueError):
        bad(f"--gpu {a.gpu!r} is unknown; choose from {sorted(GPUS)}")
    backend.check_model(a, bad)
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
    if a.backend is None and backend.simulated and gpu_visible():
        log.warning("a GPU is visible; using the simulator (--backend sglang runs SGLang)")
    startup_timeout = a.startup_timeout
    if startup_timeout is None:
        startup_timeout = backend.startup_timeout_s
    try:
        sched_opts = _kv(a.schedule_policy_opt, "--schedule-policy-opt")
        router_opts = _kv(a.router_policy_opt, "--router-policy-opt")
        make_policy(a.schedule_policy, **sched_opts)
        make_router_policy(a.router_policy, **router_opts)
    except ValueError as e:
        bad(str(e))
    try:
        oit_on, oit_opts = cluster_oit_settings(
            a.schedule_policy, sched_opts, a.cluster_oit,
            _kv(a.cluster_oit_opt, "--cluster-oit-opt"),
        )  # fmt: skip
    except ValueError as e:
        bad(str(e) if str(e).startswith("--cluster-oit-opt") else f"--cluster-oit-opt: {e}")
    if a.router_replicas is not None and a.worker_discovery_k8s:
        bad("--router-replicas starts its workers here; --worker-discovery-k8s finds them: "
            "run replicas as a Deployment instead (docs/k8s)")  # fmt: skip
    if a.router_only and not (a.worker_endpoint or a.worker_endpoints_file
                              or a.worker_discovery_k8s):  # fmt: skip
        bad("--router-only needs --worker-endpoint tcp://HOST:PORT (the workers to route to)")
    if a.router_replicas is not None:
        if a.router_replicas < 1:
            bad(f"--router-replicas must be >= 1 (got {a.router_replicas})")
        if not backend.replicable:
            bad(f"--router-replicas: --backend {backend.name} starts no workers to share; run "
                "one router per replica with the same --worker-endpoint list")  # fmt: skip
        if a.port + a.router_replicas - 1 > 65535:
            bad(f"--port {a.port} + --router-replicas {a.router_replicas} passes 65535")
    if a.tenant_limits_split < 1:
        bad(f"--tenant-limits-split must be >= 1 (got {a.tenant_limits_split})")
    if a.worker_keys is not None:
        for name in ("router.key_secret", "worker.key"):
            if not os.path.isfile(os.path.join(a.worker_keys, name)):
                bad(f"--worker-keys {a.worker_keys}: {name} is missing (python -m "
                    "sgl_fair.worker --make-keys DIR writes both)")  # fmt: skip
    shared = (
        backend.reports_service
        and a.replica_state == "shared"
        and (not backend.service_on_request or a.tenant_limits_split > 1)
    )
    if a.tenants is not None:
        try:
            load_tenants(a.tenants)
        except ConfigError as e:
            bad(f"--tenants: {e}")
    if (
        a.schedule_low_priority_values_first
        and a.rt_priority_threshold is None
        and not backend.sglang_servers  # SGLang's own flag: its servers take it alone
    ):
        bad("--schedule-low-priority-values-first needs --rt-priority-threshold")
    worker_api_key = a.worker_api_key or os.environ.get("SGLFAIR_WORKER_API_KEY") or None
    if a.worker_api_key is not None and not backend.sglang_servers:
        bad("--worker-api-key: only with --backend sglang (the SGLang servers' --api-key)")
    if a.bridges is not None and not backend.sglang_servers:
        bad("--bridges: only with --backend sglang (the bridges to SGLang servers)")
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
        cluster_oit=oit_on,
        cluster_oit_opts=oit_opts,
        chunked_prefill_size=a.chunked_prefill_size,
        max_running_requests=a.max_running_requests,
        backend=backend.name,
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
        worker_restart_backoff_s=a.worker_restart_backoff,
        sim_eos=sim_eos,
        sim_text=a.sim_text == "on",
        max_queued_requests=a.max_queued_requests or None,
        share_guard=a.share_guard,
        admin_key=a.admin_key or os.environ.get("SGLFAIR_ADMIN_KEY") or None,
        admin_loopback=a.admin_loopback == "on",
        http_header_timeout_s=a.http_header_timeout,
        max_connections=a.max_connections,
        startup_timeout_s=startup_timeout,
        min_ready_workers=a.min_ready_workers,
        worker_urls=tuple(u.rstrip("/") for u in a.worker_url),
        worker_kv_endpoints=tuple(a.worker_kv_endpoint),
        worker_kv_replay_endpoints=tuple(a.worker_kv_replay_endpoint),
        worker_api_key=worker_api_key,
        bridges=a.bridges or "router",
        sglang_args=backend.server_args(a, passthrough),
        health_check_interval_s=a.health_check_interval,
        health_check_timeout_s=a.health_check_timeout,
        rt_priority_threshold=a.rt_priority_threshold,
        low_priority_values_first=a.schedule_low_priority_values_first,
        torch_dtype=a.torch_dtype,
        torch_device=a.torch_device,
        torch_attention=a.torch_attention,
        kv_allocator=a.kv_allocator,
        kv_allocator_opts=alloc_opts,
        worker_endpoints=tuple(a.worker_endpoint),
        worker_endpoints_file=a.worker_endpoints_file,
        worker_discovery_k8s=a.worker_discovery_k8s,
        k8s_port_name=a.k8s_port_name,
        k8s_namespace=a.k8s_namespace,
        k8s_api=a.k8s_api,
        k8s_token_file=a.k8s_token_file,
        k8s_period_s=a.k8s_period_s,
        worker_keys=a.worker_keys,
        insecure=bool(a.insecure),
        router_replicas=a.router_replicas,
        replica_state=a.replica_state,
        replica_id=random.getrandbits(31) if shared else None,
        tenant_limits_split=a.tenant_limits_split,
    )


def share_guard_on(cfg: LaunchConfig) -> bool:
    """Whether the workers' schedulers run the share guard (``--share-guard``)."""
    if cfg.share_guard != "auto":
        return cfg.share_guard == "on"
    return PolicyTraits.of(policy_class(cfg.schedule_policy)).shares_running


def local_policy_opts(cfg: LaunchConfig, tenants: TenantTable | None) -> dict[str, Any]:
    """The local policy's options, with tenant weights where the policy takes weights."""
    opts = dict(cfg.schedule_policy_opts)
    cls = policy_class(cfg.schedule_policy)
    if tenants is not None and tenants.weights and PolicyTraits.of(cls).weighted:
        for key, value in cls.weight_options(tenants.weights).items():  # type: ignore[attr-defined]
            opts.setdefault(key, value)  # the user's own options win
    return opts


def cluster_oit_settings(
    schedule_policy: str, sched_opts: dict[str, Any], mode: str, opts: dict[str, Any]
) -> tuple[bool, dict[str, Any]]:
    """``--cluster-oit`` and ``--cluster-oit-opt`` resolved: whether the router throttles,
    and with which options. ``auto`` is on for the ``fairserve`` local policy unless it runs
    with ``throttle=false``. The options fairserve shares (``max_waiting``, ``kv_threshold``,
    ``interaction_timeout_s``, ``limits``) default to its ``--schedule-policy-opt`` values;
    ``--cluster-oit-opt`` overrides them (``limits`` key by key). Bad values: ValueError."""
    on = mode == "on" or (
        mode == "auto" and schedule_policy == "fairserve" and sched_opts.get("throttle", True)
    )
    if not on:
        if opts:
            why = "--cluster-oit off" if mode == "off" else f"--schedule-policy {schedule_policy}"
            raise ValueError(f"--cluster-oit-opt: the cluster OIT is off ({why}); add "
                             "--cluster-oit on")  # fmt: skip
        return False, {}
    merged: dict[str, Any] = {}
    if PolicyTraits.of(policy_class(schedule_policy)).shares_oit_options:  # fairserve and kin
        merged = {k: sched_opts[k] for k in SHARED_KEYS if k in sched_opts}
    for key, value in opts.items():
        if key == "limits" and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    ClusterOITConfig.from_options(**merged)  # checks them
    return True, merged
