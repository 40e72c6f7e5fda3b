"""The HTTP front: SGLang-native and OpenAI-compatible APIs over the live router.

Starlette on uvicorn (uvloop + httptools). Why not FastAPI's pydantic models: every body is
parsed once with msgspec (``sgl_fair.router.protocol``), which is several times faster and
lets every error name the exact field (``sampling_params.max_new_tokens``); the routes are
few and fixed. Responses are encoded with msgspec as well.

Endpoints::

    POST /generate                 SGLang-native (text or input_ids, batches, SSE streaming,
                                   logprobs as sgl.select needs them, rid, routing_key)
    POST /v1/completions           OpenAI (+ streaming, usage)
    POST /v1/chat/completions      OpenAI (+ streaming, usage)
    GET  /v1/models, /get_model_info, /model_info, /server_info, /get_server_info
    GET  /health, /health_generate, /metrics (Prometheus)
    POST /flush_cache, /abort_request

Identity (``sgl_fair.config.identity_from_headers``): with a tenants file, the API key alone
names the tenant; otherwise X-Client-Id, then OpenAI's ``user``, then ``routing_key``.
Every failure is a JSON error in OpenAI's shape with the offending field; nothing is lost:
a client that disconnects has its request aborted on the worker (freeing its KV).

Where things live: this file assembles the app (the route groups, the error handlers, the
lifespan); ``state.py`` holds :class:`ServerState` and its per-request checks (identity, tenant
limits, tokenization); ``generation.py`` one prompt's life through the router;
``routes_sglang.py``, ``routes_openai.py`` and ``routes_info.py`` the endpoints;
``http_io.py`` the JSON and error responses and the bounded body reader.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from sgl_fair.router import protocol as P
from sgl_fair.router.guard import AdminGuard
from sgl_fair.router.http_io import error_response
from sgl_fair.router.intake import IntakeMiddleware
from sgl_fair.router.routes_info import info_routes
from sgl_fair.router.routes_openai import openai_routes
from sgl_fair.router.routes_sglang import sglang_routes
from sgl_fair.router.routes_workers import worker_routes
from sgl_fair.router.state import ServerState

__all__ = ["ServerState", "build_app"]

log = logging.getLogger("sgl_fair.server")


# ---- errors: every one is OpenAI's error JSON -----------------------------------------------


async def on_protocol_error(request: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, P.ProtocolError)
    return error_response(exc)  # with its Retry-After, if it has one


async def on_http_error(request: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status == 404:
        msg = f"no such endpoint: {request.method} {request.url.path}"
    elif status == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    return error_response(P.ProtocolError(status, msg, None))


async def on_error(request: HTTPRequest, exc: Exception) -> Response:
    if isinstance(exc, RecursionError):  # a body nested thousands deep: the client's fault
        return error_response(P.ProtocolError(400, "the JSON body is nested too deeply", None))
    log.exception("internal error on %s", request.url.path)
    return error_response(P.ProtocolError(500, f"internal error: {type(exc).__name__}", None))


# ---- the app --------------------------------------------------------------------------------


def build_app(
    state: ServerState,
    *,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> AdminGuard:
    """The app over ``state``: its route groups, every error as OpenAI's error JSON,
    ``on_startup`` / ``on_shutdown`` run around serving, and the intake in front of it all
    (``intake.py``: the bounded queue and the bounded work per loop pass)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    routes = [*sglang_routes(state), *openai_routes(state), *info_routes(state)]
    if state.membership is not None:  # GET/POST /workers, DELETE /workers/{id}
        routes += worker_routes(state, state.membership)
    app = Starlette(
        routes=routes,
        exception_handlers={
            P.ProtocolError: on_protocol_error,
            HTTPException: on_http_error,
            Exception: on_error,
        },
        lifespan=lifespan,
    )
    intake = IntakeMiddleware(
        app,
        max_queued=state.cfg.max_queued_requests,
        max_body_bytes=state.cfg.max_body_bytes,
        on_reject=state.telemetry.queue_full,
    )
    state.telemetry.track_intake(intake)
    return AdminGuard(
        intake,
        admin_key=state.cfg.admin_key,
        tenants=state.tenants,
        allow_loopback=state.cfg.admin_loopback,
    )
