"""The HTTP front's shared state, and the checks a request passes before it reaches a worker.

:class:`ServerState` holds what every handler needs (router service, tokenizer, tenants,
limits) and answers for the server as a whole: who is asking (:meth:`ServerState.identify`,
an :class:`Identity`), whether their tenant may send more now
(:meth:`ServerState.check_tenant_limits`: requests per minute and in flight, HTTP 429), and
what a prompt is in tokens (:meth:`ServerState.tokenize`: the vocabulary, the context
length, the tenant's input cap).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from sgl_fair import config as tenants_mod
from sgl_fair.router import protocol as P
from sgl_fair.router.oit import ClusterOIT, ClusterOITConfig
from sgl_fair.router.policies import make_router_policy
from sgl_fair.router.replica import ReplicaRouter
from sgl_fair.router.router import Router
from sgl_fair.router.service import RouterService
from sgl_fair.router.telemetry import Telemetry
from sgl_fair.router.tokenizer import Tokenizer
from sgl_fair.transport import Endpoints


@dataclass
class Identity:
    client: str  # the scheduling identity (tenant name with keys)
    tenant: Any  # config.Tenant or None


@dataclass
class ServerState:
    """Everything the handlers share: router service, tokenizer, tenants, limits."""

    cfg: Any  # LaunchConfig
    tokenizer: Tokenizer
    tenants: tenants_mod.TenantTable | None
    service: RouterService
    telemetry: Telemetry
    limits: P.Limits
    model_name: str
    kv_capacity_tokens: int
    url: str = ""
    worker_urls: list[str] = field(default_factory=list)  # --backend sglang: the servers
    features: P.EngineFeatures = P.NO_PASSTHROUGH  # what the protocol may pass to the engine
    started_s: float = field(default_factory=time.time)
    inflight: dict[str, int] = field(default_factory=dict)  # tenant -> calls in flight
    limiters: dict[str, Any] = field(default_factory=dict)  # tenant -> RateLimiter
    membership: Any = None  # router/membership.py, once serving: workers joining and leaving

    @classmethod
    def create(
        cls,
        cfg: Any,
        *,
        tokenizer: Tokenizer,
        tenants: tenants_mod.TenantTable | None,
        ipc_dir: str,
        kv_capacity_tokens: int,
        context_len: int,
        kv_endpoints: list[str] | None = None,
        kv_replay_endpoints: list[str | None] | None = None,
        worker_urls: list[str] | None = None,
        follow_kv_events: bool = True,
        features: P.EngineFeatures = P.NO_PASSTHROUGH,
        local_workers: int | None = None,
    ) -> ServerState:
        """``kv_capacity_tokens`` / ``context_len``: one worker's KV pool and the model's
        context, as the launcher knows them before the workers start (a real engine's numbers
        replace them: ``adopt_engine_limits``). ``kv_endpoints``: where each worker publishes
        its KV events (default: the sim workers' sockets in ``ipc_dir``). Without KV events
        (``follow_kv_events=False``) the router's tree also takes each finished request's
        output, as its best guess. ``features``: what the workers' engine honours beyond
        the router's own fields (the parsers pass SGLang's extras through only with it).
        ``local_workers``: the workers on this host's ipc sockets (default ``cfg.dp``; 0
        when every worker is remote and joins through ``membership``)."""
        kv_cap = kv_capacity_tokens
        context = cfg.context_length or context_len
        router = build_router(cfg, follow_kv_events=follow_kv_events)
        telemetry = Telemetry(tenants=[t.name for t in tenants.tenants] if tenants else ())
        telemetry.watch_tree(router.tree)
        service = RouterService(
            router,
            Endpoints.ipc(ipc_dir),
            cfg.dp if local_workers is None else local_workers,
            telemetry=telemetry,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            kv_endpoints=kv_endpoints,
            kv_replay_endpoints=kv_replay_endpoints,
        )
        telemetry.replicas.watch(service)  # the replica layer on /metrics, read at scrape
        limiters = {}
        if tenants is not None:
            for t in tenants.tenants:
                limiter = t.make_limiter(time.monotonic())
                if limiter is not None:
                    limiters[t.name] = limiter
        name = cfg.served_model_name or cfg.model_path or cfg.model
        return cls(
            cfg=cfg,
            tokenizer=tokenizer,
            tenants=tenants,
            service=service,
            telemetry=telemetry,
            limits=P.Limits(context_len=min(context, kv_cap)),
            model_name=name,
            kv_capacity_tokens=kv_cap,
            worker_urls=list(worker_urls or []),
            features=features,
            limiters=limiters,
        )

    def adopt_engine_limits(self, *, context_len: int | None, model_name: str | None) -> None:
        """Real engines (``--backend sglang``): the KV capacity the workers reported in their
        ``Hello`` and the servers' context length replace the simulator's model. Call once
        every worker is ready, before the app is built."""
        caps = [w.kv_capacity_tokens for w in self.service.workers.values() if w.kv_capacity_tokens]
        if caps:
            self.kv_capacity_tokens = min(caps)
        context = self.cfg.context_length or context_len or self.limits.context_len
        self.limits = P.Limits(context_len=min(context, self.kv_capacity_tokens))
        if model_name and not (self.cfg.served_model_name or self.cfg.model_path):
            self.model_name = model_name

    def describe(self, engine: str) -> str:
        """One line for the launcher's ``ready`` message; ``engine`` names the engine (the
        launcher's backend knows how)."""
        cfg = self.cfg
        auth = f"{len(self.tenants.tenants)} tenants" if self.tenants else "no auth"
        return (
            f"dp={cfg.dp} · {engine} · "
            f"router {cfg.router_policy} · local {cfg.schedule_policy} · {auth}"
        )

    def identify(self, request: HTTPRequest, user: str | None, routing_key: str | None) -> Identity:
        """Who sent ``request`` (``config.identity_from_headers``): 401 for a bad API key, 400
        for a bad client id."""
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            client, tenant = tenants_mod.identity_from_headers(
                self.tenants, headers, user, routing_key
            )
        except tenants_mod.AuthError as e:
            raise P.ProtocolError(401, str(e), None) from None
        except tenants_mod.BadClientId as e:
            raise P.ProtocolError(400, str(e), None) from None
        return Identity(client, tenant)

    def scheduling(self, request: HTTPRequest, hints: Any, who: Identity) -> P.Scheduling:
        """The request's service class, SLOs and interaction (``protocol.scheduling``): its
        body's fields, else its headers, else SGLang's ``priority`` (with
        ``--rt-priority-threshold``), else the tenant's default class. With API keys the
        interaction id is namespaced by the tenant. A bad header is a 400 naming it."""
        headers = {k.lower(): v for k, v in request.headers.items()}
        tenant = who.tenant
        if tenant is None and self.tenants is not None:
            tenant = self.tenants.effective(who.client)  # unlisted: the [defaults]
        keyed = self.tenants is not None and self.tenants.requires_auth
        sched = P.resolve_scheduling(
            hints if hints is not None else P.Hints(),
            headers,
            tenant_class=getattr(tenant, "priority_class", None),
            namespace=who.client if keyed else None,
            rt_priority_threshold=getattr(self.cfg, "rt_priority_threshold", None),
            low_priority_values_first=getattr(self.cfg, "low_priority_values_first", False),
        )
        if sched.priority_class == "rt" and not getattr(tenant, "allow_rt", True):
            raise P.ProtocolError(
                403, f"tenant {who.client!r} may not send real-time requests "
                "(allow_rt = false in the tenants file)", "priority_class",
            )  # fmt: skip
        return sched

    def check_tenant_limits(self, who: Identity, n: int) -> None:
        """Tenant limits: requests per minute and requests in flight (HTTP 429)."""
        t = who.tenant
        if t is None:
            return
        limiter = self.limiters.get(t.name)
        if limiter is not None:
            wait = None
            for _ in range(n):
                wait = limiter.try_acquire(time.monotonic())
                if wait is not None:
                    break
            if wait is not None:
                self.telemetry.rejected(who.client, "rpm")
                raise P.ProtocolError(
                    429, f"tenant {t.name!r} is over its rate limit of {t.rpm} requests/min",
                    None, retry_after_s=wait,
                )  # fmt: skip
        cap = t.max_inflight
        if cap is not None and self.inflight.get(t.name, 0) + n > cap:
            self.telemetry.rejected(who.client, "max_inflight")
            raise P.ProtocolError(
                429, f"tenant {t.name!r} already has {self.inflight.get(t.name, 0)} requests "
                f"in flight (max_inflight = {cap})", None, retry_after_s=1.0,
            )  # fmt: skip

    def tokenize(
        self, item: Any, param: str, who: Identity, *, chat: bool = False
    ) -> tuple[list[int], int]:
        """Prompt ids and the max_new_tokens that fits the context (SGLang clips it)."""
        if item.input_ids is not None:
            ids = list(item.input_ids)
            P.check_ids(ids, self.tokenizer.vocab_size, param)
        else:
            ids = self.tokenizer.encode(item.text, add_special_tokens=not chat)
            if not ids:
                raise P.ProtocolError(400, f"{param} is empty after tokenization", param)
        max_new = P.check_prompt_length(len(ids), item.sampling.max_new_tokens, self.limits, param)
        if item.return_logprob and item.logprob_start_len >= 0:
            P.check_logprob_start_len(item.logprob_start_len, len(ids))
        t = who.tenant
        cap = getattr(t, "max_input_tokens", None) if t is not None else None
        if cap is not None and len(ids) > cap:
            raise P.ProtocolError(
                400, f"{param} has {len(ids)} tokens; tenant limit is {cap}", param
            )
        return ids, max_new


def build_router(cfg: Any, *, follow_kv_events: bool) -> Router:
    """The launch config's router: its policy over ``cfg.dp`` workers, the cluster OIT if
    asked, a ``ReplicaRouter`` where replicas share service reports."""
    oit = None
    if getattr(cfg, "cluster_oit", False):  # FairServe's OIT over the cluster (oit.py)
        oit_cfg = ClusterOITConfig.from_options(**getattr(cfg, "cluster_oit_opts", {}))
        oit = ClusterOIT(oit_cfg.split(getattr(cfg, "tenant_limits_split", 1)))
    # A replica among several that share fairness state through the workers' reports
    # (router/replica.py) is a ReplicaRouter; it decides as a Router does otherwise.
    replica = getattr(cfg, "replica_id", None)
    router = (Router if replica is None else ReplicaRouter)(
        make_router_policy(cfg.router_policy, **cfg.router_policy_opts),
        cfg.dp,
        **({} if replica is None else {"replica": replica}),
        insert_outputs=not follow_kv_events,  # else the workers' KV events say it
        max_tree_tokens=cfg.max_tree_tokens,
        oit=oit,
        # one of several replicas that share no service reports: the workers' Loads
        # count the others' requests too (the server's own counts over SGLang)
        queues_from_loads=replica is None and getattr(cfg, "tenant_limits_split", 1) > 1,
    )
    return router
