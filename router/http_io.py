"""Starlette plumbing the route groups share: msgspec-encoded JSON responses, OpenAI-shaped
error responses, and request bodies read under a size limit."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from sgl_fair.router import protocol as P

_json = msgspec.json.Encoder()


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def error_response(err: P.ProtocolError, headers: dict[str, str] | None = None) -> Response:
    """The error's JSON body; its ``Retry-After`` unless ``headers`` are given."""
    return Response(
        err.body(),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers() if headers is None else headers,
    )


async def read_json_body(request: HTTPRequest, limit: int) -> bytes:
    """The body, or a 413 as soon as it (or its declared length) passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.ProtocolError(413, f"request body is larger than {limit} bytes", None)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.ProtocolError(413, f"request body is larger than {limit} bytes", None)
        chunks.append(chunk)
    return b"".join(chunks)
