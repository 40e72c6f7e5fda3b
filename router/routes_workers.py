"""Membership at run time, for operators (``router/membership.py`` does the work)::

    GET    /workers                  every worker: id, endpoint, state, in flight, health
    POST   /workers                  {"endpoint": "tcp://HOST:PORT"} -> 201 {"id", "state"};
                                     over SGLang servers {"url": "http://HOST:PORT",
                                     "kv_endpoint": "tcp://HOST:PORT"} (its plugin checked)
    DELETE /workers/{id}             drain, then remove (202 {"id", "state": "draining"});
                                     ?drain=false removes at once (200)

All three need an operator (the admin guard's rule: ``--admin-key``, an admin tenant's key,
or loopback unless ``--admin-loopback off``). Errors are OpenAI's error JSON naming the field:
a bad or duplicate ``endpoint`` (400 / 409), an unknown id (404), a launcher's own worker
(409: it can be drained, not removed).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from sgl_fair.router import protocol as P
from sgl_fair.router.guard import admin_refusal
from sgl_fair.router.http_io import JSON, error_response, read_json_body
from sgl_fair.router.membership import Membership, MembershipError


class AddWorker(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: str | None = None  # a standalone worker: tcp://HOST:PORT
    url: str | None = None  # an SGLang server (--backend sglang): http(s)://HOST:PORT
    kv_endpoint: str | None = None  # … and where it publishes its KV events
    kv_replay_endpoint: str | None = None  # … and replays the ones missed


def _refused(state: Any, request: HTTPRequest) -> Response | None:
    refusal = admin_refusal(
        request.scope, "/workers", admin_key=state.cfg.admin_key, tenants=state.tenants,
        allow_loopback=state.cfg.admin_loopback,
    )  # fmt: skip
    return None if refusal is None else error_response(refusal)


def _error(e: MembershipError, param: str | None) -> Response:
    return error_response(P.ProtocolError(e.status, str(e), param))


async def list_workers(state: Any, membership: Membership, request: HTTPRequest) -> Response:
    return _refused(state, request) or JSON({"workers": membership.describe()})


async def add_worker(state: Any, membership: Membership, request: HTTPRequest) -> Response:
    refused = _refused(state, request)
    if refused is not None:
        return refused
    body = await read_json_body(request, 64 * 1024)
    try:
        spec = msgspec.json.decode(body, type=AddWorker)
    except msgspec.ValidationError as e:
        return error_response(P.ProtocolError(400, f"bad body: {e}", "endpoint"))
    except msgspec.DecodeError:
        return error_response(P.ProtocolError(400, "the body is not JSON", None))
    if (spec.endpoint is None) == (spec.url is None):
        return error_response(P.ProtocolError(
            400, "give endpoint (a standalone worker) or url (an SGLang server), one of them",
            "endpoint",
        ))  # fmt: skip
    if spec.endpoint is not None and (spec.kv_endpoint or spec.kv_replay_endpoint):
        field = "kv_endpoint" if spec.kv_endpoint else "kv_replay_endpoint"
        return error_response(P.ProtocolError(
            400, f"{field}: only with url (a standalone worker publishes at its PORT+1)", field
        ))  # fmt: skip
    try:
        if spec.endpoint is not None:
            wid = membership.add(spec.endpoint)
        else:
            wid = await membership.add_server(spec.url, spec.kv_endpoint, spec.kv_replay_endpoint)
    except MembershipError as e:
        return _error(e, _field_of(e))
    where = spec.endpoint if spec.endpoint is not None else spec.url
    return JSON({"id": wid, "endpoint": where, "state": membership.state(wid)}, 201)


def _field_of(e: MembershipError) -> str:
    """The body field an error names (``MembershipError.field``), else ``endpoint``."""
    return e.field or "endpoint"


async def remove_worker(state: Any, membership: Membership, request: HTTPRequest) -> Response:
    refused = _refused(state, request)
    if refused is not None:
        return refused
    raw = request.path_params["wid"]
    if not raw.isdigit():
        return error_response(P.ProtocolError(400, f"worker id must be an integer: {raw!r}", "id"))
    drain = request.query_params.get("drain", "true")
    if drain not in ("true", "false"):
        return error_response(P.ProtocolError(400, "drain must be true or false", "drain"))
    wid = int(raw)
    try:
        await membership.remove(wid, drain=drain == "true")
    except MembershipError as e:
        return _error(e, "id")
    if drain == "true" and wid in membership.members:
        return JSON({"id": wid, "state": "draining", "in_flight": membership.in_flight(wid)}, 202)
    return JSON({"id": wid, "state": "removed"}, 200)


def worker_routes(state: Any, membership: Membership) -> list[Route]:
    return [
        Route("/workers", partial(list_workers, state, membership), methods=["GET"]),
        Route("/workers", partial(add_worker, state, membership), methods=["POST"]),
        Route("/workers/{wid}", partial(remove_worker, state, membership), methods=["DELETE"]),
    ]


__all__ = ["add_worker", "list_workers", "remove_worker", "worker_routes"]
