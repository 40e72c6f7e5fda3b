"""uvicorn's httptools protocol with two guards uvicorn lacks: a header timeout and a cap on
open connections.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection
that never completes its first request's headers — idle, or a slowloris trickling a byte at
a time — stays open forever; 20,000 of them exhausted the process's file limit and normal
requests then failed. Here:

* **Header timeout**: a connection has ``header_timeout_s`` from when it opens (or finishes
  its last response) until its next request's headers are complete; then it is closed.
* **Connection cap**: past ``max_connections`` open connections, opening one more closes the
  longest-idle connection that has no request in flight (never one being served). So a
  flood of idle sockets costs the server at most ``max_connections`` file descriptors, and a
  real request always finds a place.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def connection_options(*, header_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """``uvicorn.Config``'s connection options for sgl-fair's HTTP server.

    An idle keep-alive connection is closed ``header_timeout_s`` after its last response, by
    uvicorn's keep-alive timer and the header timer alike (uvicorn's own default, 5 s, would
    close it first). A client must drop an idle connection before that: a call sent on a
    connection the server is closing is reset. The load client's pool keeps one
    ``workloads.loadclient.KEEPALIVE_S`` (3 s), under SGLang's 5 s too."""
    return {
        "http": guarded_protocol(
            header_timeout_s=header_timeout_s, max_connections=max_connections
        ),
        "timeout_keep_alive": header_timeout_s,
    }


def guarded_protocol(*, header_timeout_s: float, max_connections: int) -> type:
    """A protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    if header_timeout_s <= 0 or max_connections < 1:
        raise ValueError("header_timeout_s must be > 0 and max_connections >= 1")
    # Connections with no request in flight, oldest first (shared by all connections of the
    # server that uses this class).
    idle: collections.OrderedDict[Any, None] = collections.OrderedDict()
    closing: set[Any] = set()  # closed by us, not yet gone from uvicorn's connection set

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._become_idle()
            while len(self.connections) - len(closing) > max_connections:
                oldest = next(iter(idle))  # self is in it, last
                if oldest is self:
                    break  # every other connection is being served: keep them all
                oldest._close("too many open connections")

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            idle.pop(self, None)
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._become_idle()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            idle.pop(self, None)
            closing.discard(self)
            super().connection_lost(exc)

        def _become_idle(self) -> None:
            idle[self] = None
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._close, "timeout")

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _close(self, why: str) -> None:
            idle.pop(self, None)
            self._cancel_header_timer()
            if not self.transport.is_closing():
                closing.add(self)
                self.transport.close()

    return GuardedHttpToolsProtocol
