"""Who may read the operator's endpoints: ``/metrics``, ``/server_info``, ``/get_server_info``
and ``/flush_cache``.

They show tenant names, weights, per-tenant counts and worker PIDs, or act on every tenant,
so only operators reach them. ``AdminGuard`` (pure ASGI, in front of the routes) lets a
request through when it carries ``Authorization: Bearer K`` where ``K`` is ``--admin-key``
or an API key of a tenant with ``admin = true``, or — unless ``--admin-loopback off`` — when
it comes from loopback (a local Prometheus, the operator's shell). Anything else gets 401
(no key) or 403 (a key that is not an admin's), as OpenAI's error JSON. Prometheus scrapes
with ``authorization: {credentials: K}`` in its scrape config.

The per-request admin checks inside the routes (a tenant may abort only its own requests)
stay where they are; this guard only closes the operator's views.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sgl_fair.config import TenantTable
from sgl_fair.router import protocol as P

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

ADMIN_PATHS = frozenset({"/metrics", "/server_info", "/get_server_info", "/flush_cache"})
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class AdminGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        admin_key: str | None,
        tenants: TenantTable | None,
        allow_loopback: bool = True,
    ) -> None:
        self.app = app
        self.admin_key = admin_key
        self.tenants = tenants
        self.allow_loopback = allow_loopback

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in ADMIN_PATHS:
            refusal = self.refusal(scope)
            if refusal is not None:
                await _send_error(send, refusal)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> P.ProtocolError | None:
        """None when the caller may go on, else the error to answer."""
        return admin_refusal(
            scope, scope["path"], admin_key=self.admin_key, tenants=self.tenants,
            allow_loopback=self.allow_loopback,
        )  # fmt: skip


def admin_refusal(
    scope: Scope,
    what: str,
    *,
    admin_key: str | None,
    tenants: TenantTable | None,
    allow_loopback: bool,
) -> P.ProtocolError | None:
    """The guard's rule for one request (also ``abort_all`` without tenant keys): None when
    the caller is an operator, else the 401/403 to answer, naming ``what``."""
    client = scope.get("client")
    if allow_loopback and client and client[0] in LOOPBACK:
        return None
    key = _bearer(scope)
    if key is None:
        return P.ProtocolError(
            401, f"{what} is for operators: send Authorization: Bearer <admin key>", None
        )
    if admin_key is not None and hmac.compare_digest(key, admin_key):
        return None
    tenant = tenants.by_key(key) if tenants is not None else None
    if tenant is not None and tenant.admin:
        return None
    return P.ProtocolError(403, f"{what} needs an admin key", None)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


async def _send_error(send: Any, err: P.ProtocolError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
