"""Errors: :class:`ProtocolError` (a status, a message, the offending field) and OpenAI's error
body, which every failure of the HTTP front answers with, streaming or not."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
]


def error_type(status: int) -> ErrorType:
    """OpenAI's error ``type`` for an HTTP status (clients branch on it, e.g. retry on 429)."""
    if status >= 500:
        return "server_error"
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error")


class ProtocolError(Exception):
    """A request the server answers with ``status`` and OpenAI's error body.

    ``param`` is the JSON path of the offending field (``messages[1].content``), or None
    when the problem is not one field (a body that is not JSON). ``retry_after_s`` (for a
    429 or 503) becomes a ``Retry-After`` header via :meth:`headers`. ``details``: more keys
    of the error object (a throttled request's ``throttle``: which limit, its window).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        retry_after_s: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.details = details  # extra keys of the error object (e.g. ``throttle``)

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds, rounded up (HTTP has no fractions), if set."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    @property
    def type(self) -> ErrorType:
        return error_type(self.status)

    def to_dict(self) -> dict[str, Any]:
        error = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.status,
        }
        if self.details:
            error.update(self.details)
        return {"error": error}

    def body(self) -> bytes:
        return msgspec.json.encode(self.to_dict())

    def __repr__(self) -> str:
        return f"ProtocolError({self.status}, {self.message!r}, param={self.param!r})"
