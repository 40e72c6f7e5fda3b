"""What the server is and how it is doing, and its admin actions.

``GET /get_model_info`` (alias ``/model_info``), ``/get_server_info`` (alias ``/server_info``:
SGLang's server-args keys, then ours, the per-worker state under ``workers``), ``/get_load``,
``/health``, ``/health_generate`` (one real token through a worker), ``/metrics``
(Prometheus); ``/flush_cache`` (admin tenants only, when keys are required) and
``POST /abort_request`` (a tenant may abort only its own requests unless it is an admin).
"""

from __future__ import annotations

import asyncio
import math
import time
from functools import partial
from typing import Any

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from sgl_fair.router import protocol as P
from sgl_fair.router.generation import Generation
from sgl_fair.router.guard import admin_refusal
from sgl_fair.router.http_io import JSON, error_response, read_json_body
from sgl_fair.router.lifecycle import run_to_end
from sgl_fair.router.router import WorkerStats
from sgl_fair.router.service import NoWorkerError
from sgl_fair.router.state import Identity, ServerState


def membership_row(state: Any, wid: int) -> dict[str, Any]:
    """A worker's membership state (starting, ready, draining, dead) and endpoint
    (``router/membership.py``), once the server runs."""
    m = state.membership
    if m is None:
        return {}
    member = m.members.get(wid)
    return {"state": m.state(wid), "endpoint": (member.endpoint if member else None) or "local"}


async def get_model_info(state: ServerState, request: HTTPRequest) -> Response:
    tok = state.tokenizer
    limits = state.limits
    return JSON(
        P.model_info(
            state.model_name,
            tokenizer_path=tok.name,
            served_model_name=state.model_name,
            context_length=limits.context_len,
            max_total_num_tokens=state.kv_capacity_tokens,
        )
    )


def server_info_dict(state: ServerState) -> dict[str, Any]:
    svc = state.service
    tok = state.tokenizer
    limits = state.limits
    cfg = state.cfg
    router = svc.router
    held = router.tree.tokens_by_worker()
    workers = []
    for w in svc.workers.values():
        load = router.load(w.wid)
        stats = router.stats.get(w.wid) or WorkerStats()  # none until its first Hello
        workers.append(
            {
                "id": w.wid,
                "alive": w.alive,
                "pid": w.pid,
                "engine": w.engine,
                "death": w.death,
                "restarts": w.num_restarts,
                "revived": w.num_revived,
                **membership_row(state, w.wid),
                "restart_in_s": svc.restart_in_s(w.wid),
                "queue_len": router.queue_len(w.wid),
                "dispatched": stats.num_dispatched,
                "stopping": w.stopping,  # its Load says it drains (SIGTERM)
                "num_waiting": load.num_waiting if load else None,
                "num_running": load.num_running if load else None,
                "kv_used_tokens": load.kv_used_tokens if load else None,
                "kv_cached_tokens": load.kv_cached_tokens if load else None,
                "num_retractions": load.num_retractions if load else None,
                "kv_capacity_tokens": w.kv_capacity_tokens,
                "kv_event_gaps": w.kv_gaps,
                "kv_events_replayed": w.kv_replayed,
                "kv_orphans": w.decoder.num_orphans,
                "tree_tokens": held.get(w.wid, 0),
                "kv_events": stats.num_kv_events,
                **({"url": state.worker_urls[w.wid]} if w.wid < len(state.worker_urls) else {}),
            }
        )
    tenants = None
    if state.tenants is not None:
        tenants = [{"name": t.name, "weight": t.weight} for t in state.tenants.tenants]
    return {
        # SGLang's server-args keys (what its tooling reads) ...
        "version": "sgl-fair 0.1.0",
        "model_path": cfg.model_path or state.model_name,
        "tokenizer_path": tok.name,
        "served_model_name": state.model_name,
        "dp_size": cfg.dp,
        "tp_size": cfg.tp or 1,
        "pp_size": 1,
        "page_size": 1,
        "max_total_num_tokens": state.kv_capacity_tokens,
        "max_prefill_tokens": cfg.chunked_prefill_size,
        "load_balance_method": cfg.router_policy,
        "skip_tokenizer_init": False,
        "is_embedding": False,
        "enable_lora": state.features.passthrough,  # LoRA passes through to the engine
        "internal_states": [
            {"dp_rank": w["id"], "avg_spec_accept_length": None, **w} for w in workers
        ],
        # ... then ours; the per-worker state is under "workers"
        "backend": cfg.backend,
        # the simulated engine's GPU, model and clock; null where a real engine serves
        **(
            {
                "gpu": cfg.gpu,
                "model": cfg.model,
                "time_scale": None if math.isinf(cfg.time_scale) else cfg.time_scale,
            }
            if state.features.simulated
            else {"gpu": None, "model": state.model_name, "time_scale": None}
        ),  # fmt: skip
        "schedule_policy": cfg.schedule_policy,
        "schedule_policy_opts": cfg.schedule_policy_opts,
        # what our SGLang plugin reports (worker/sglang/plugin.py): the workers' policy,
        # so a bridge in front of this server (--worker-url) accepts it
        "sgl_fair": {"policy": cfg.schedule_policy, "opts": cfg.schedule_policy_opts},
        "router_policy": cfg.router_policy,
        "router_policy_opts": cfg.router_policy_opts,
        "cluster_oit": svc.router.oit is not None,
        "cluster_oit_opts": getattr(cfg, "cluster_oit_opts", {}) if svc.router.oit else None,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_running_requests": cfg.max_running_requests,
        "context_length": limits.context_len,
        "kv_page_size": cfg.kv_page_size,
        "tokenizer": tok.name,
        "auth": state.tenants is not None and state.tenants.requires_auth,
        "tenants": tenants,
        "workers": workers,
        "in_flight": len(svc.calls),
        "redispatched": svc.num_redispatched,
        "failed_by_worker_death": svc.num_failed_by_death,
        "uptime_s": round(time.time() - state.started_s, 3),
    }


async def server_info(state: ServerState, request: HTTPRequest) -> Response:
    return JSON(server_info_dict(state))


async def get_load(state: ServerState, request: HTTPRequest) -> Response:
    """``GET /get_load``: SGLang's per-data-parallel-rank load, one entry per worker
    (requests running and waiting, KV tokens in use), as its gateway polls it."""
    svc = state.service
    router = svc.router
    out = []
    for w in svc.workers.values():
        load = router.load(w.wid) if w.alive else None
        running = load.num_running if load else 0
        waiting = (load.num_waiting if load else 0) + router.queue_len(w.wid)
        out.append(
            {
                "dp_rank": w.wid,
                "num_reqs": running + waiting,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_tokens": load.kv_used_tokens if load else 0,
                "alive": w.alive,
            }
        )
    return JSON(out)


async def health(state: ServerState, request: HTTPRequest) -> Response:
    """SGLang's shape when all is well (200, empty); a degraded cluster still answers 200
    but says which workers are down and when each restarts; none alive is 503."""
    svc = state.service
    down = [
        {
            "id": w.wid,
            "death": w.death,
            "restarts": w.num_restarts,
            "restart_in_s": svc.restart_in_s(w.wid),
        }
        for w in svc.workers.values()
        if not w.alive
    ]
    if not down:
        return Response(b"", status_code=200)
    if svc.router.workers:
        body = {"status": "degraded", "workers_alive": len(svc.router.workers), "down": down}
        return JSON(body)
    err = P.ProtocolError(
        503, f"no worker is alive: {down}", None, retry_after_s=svc.retry_after_s()
    )
    return error_response(err)


async def health_generate(state: ServerState, request: HTTPRequest) -> Response:
    limits = state.limits
    item = P.parse_generate(
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', limits
    ).items[0]
    g = Generation(state, item, [1], 1, Identity("health", None))
    try:
        g.start()
    except NoWorkerError:
        return error_response(P.ProtocolError(503, "no worker is alive", None))
    try:
        await asyncio.wait_for(run_to_end(request, [g]), 20.0)
    except asyncio.TimeoutError:
        g.abort("health check timed out")
        return error_response(P.ProtocolError(503, "generation timed out", None))
    if g.failed is not None:
        return error_response(P.ProtocolError(503, str(g.failed.message), None))
    return Response(b"", status_code=200)


def require_admin(state: ServerState, request: HTTPRequest) -> Identity:
    who = state.identify(request, None, None)
    keyed = state.tenants is not None and state.tenants.requires_auth
    if keyed and not getattr(who.tenant, "admin", False):
        raise P.ProtocolError(
            403, f"tenant {who.client!r} may not do this (needs admin = true)", None
        )
    return who


async def flush_cache(state: ServerState, request: HTTPRequest) -> Response:
    svc = state.service
    require_admin(state, request)
    answers = await svc.flush_cache()
    refused = sorted(w for w, ok in answers.items() if not ok)
    if refused:
        return error_response(
            P.ProtocolError(
                400, f"cache not flushed on workers {refused}: requests are in flight", None
            )
        )
    return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")


async def abort_request(state: ServerState, request: HTTPRequest) -> Response:
    svc = state.service
    body = await read_json_body(request, state.cfg.max_body_bytes)
    try:
        obj = msgspec.json.decode(body or b"{}")
    except msgspec.DecodeError as e:
        raise P.ProtocolError(400, f"request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise P.ProtocolError(400, "request body must be a JSON object", None)
    rid = obj.get("rid")
    abort_all = obj.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise P.ProtocolError(400, "abort_all must be a boolean", "abort_all")
    if rid is not None and not isinstance(rid, str):
        raise P.ProtocolError(400, "rid must be a string", "rid")
    if rid is None and not abort_all:
        raise P.ProtocolError(400, "give a rid or abort_all = true", "rid")
    who = state.identify(request, None, None)
    keyed = state.tenants is not None and state.tenants.requires_auth
    if abort_all and not keyed:
        # Without tenant keys nobody owns a request: aborting everyone's is for operators
        # (--admin-key, or loopback unless --admin-loopback off), like /flush_cache.
        refusal = admin_refusal(
            request.scope, "abort_all", admin_key=state.cfg.admin_key,
            tenants=state.tenants, allow_loopback=state.cfg.admin_loopback,
        )  # fmt: skip
        if refusal is not None:
            raise refusal
    admin = bool(getattr(who.tenant, "admin", False))
    n = 0
    for call in list(svc.calls.values()):
        if not abort_all and call.rid != rid:
            continue
        if keyed and not admin and call.tenant != who.client:
            continue  # a tenant may abort only its own requests
        svc.abort(call, "aborted by /abort_request")
        n += 1
    return JSON({"aborted": n})


async def metrics(state: ServerState, request: HTTPRequest) -> Response:
    return Response(state.telemetry.render(), media_type=state.telemetry.content_type)


def info_routes(state: ServerState) -> list[Route]:
    """The info, health, admin and metrics routes over ``state``."""
    return [
        Route("/get_model_info", partial(get_model_info, state), methods=["GET"]),
        Route("/model_info", partial(get_model_info, state), methods=["GET"]),
        Route("/server_info", partial(server_info, state), methods=["GET"]),
        Route("/get_server_info", partial(server_info, state), methods=["GET"]),
        Route("/get_load", partial(get_load, state), methods=["GET"]),
        Route("/health", partial(health, state), methods=["GET"]),
        Route("/health_generate", partial(health_generate, state), methods=["GET"]),
        Route("/flush_cache", partial(flush_cache, state), methods=["POST", "GET"]),
        Route("/abort_request", partial(abort_request, state), methods=["POST"]),
        Route("/metrics", partial(metrics, state), methods=["GET"]),
    ]
