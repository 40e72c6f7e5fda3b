"""The bridge's streaming calls to SGLang (``POST /generate``): HTTP/1.1 on a raw asyncio
protocol, each server-sent event handed to the bridge as it is parsed (issue 39, item 2).

SGLang streams one event per request per decode step. Read through aiohttp, every event
woke the call's task: the connection's protocol fed a ``StreamReader``, which resolved the
future the task awaited, whose next step took the chunk and parsed it — a task step, a future
and a reader's bookkeeping per streamed token, on top of the socket read. Here the parsing
happens in the loop's read callback itself: ``httptools`` (C) takes the bytes off the chunked
encoding, :class:`~sgl_fair.worker.sglang.http_api.SSEParser` splits the events, and each
event's payload goes to the call's ``on_event`` at once; the call's task wakes only when the
stream ends. A connection is kept alive and reused (the bridge's calls to one server share a
pool, as they shared aiohttp's), never one older than ``IDLE_REUSE_S`` (SGLang's uvicorn
closes idle ones after 5 s; a request sent on a connection the server is closing would fail).

Failures are what the bridge already tells apart: ``OSError`` (refused, reset, closed before
the end), ``asyncio.TimeoutError`` (connecting), ``ValueError`` (a response that is not HTTP,
or an event ``on_event`` cannot read).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from sgl_fair.worker.sglang.http_api import SSEParser

IDLE_REUSE_S = 2.0  # an idle connection older than this is closed, not reused
MAX_IDLE = 64  # idle connections kept per server
AFTER_DONE_S = 1.0  # after "[DONE]", how long the response's end may take (then: closed)


class Call(asyncio.Protocol):
    """One connection to the server; one exchange on it at a time (``start``).
    ``result``: the status code once the stream ended (``[DONE]``, or the response's end),
    or the failure."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.result: asyncio.Future[int] | None = None  # this exchange's end
        self.status = 0
        self.ended = True  # no exchange under way
        self._late: asyncio.TimerHandle | None = None

    # ---- an exchange ------------------------------------------------------------------------

    def start(self, request: bytes, on_event: Callable[[bytes], None]) -> None:
        self.on_event = on_event
        self.parser = httptools.HttpResponseParser(self)
        self.sse = SSEParser()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()  # a response that is not a stream (an error's body)
        self.ended = False  # the whole response read: the connection can be reused
        self.result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._late: asyncio.TimerHandle | None = None
        assert self.transport is not None
        self.transport.write(request)

    def hang_up(self, result: asyncio.Future[int]) -> None:
        """The caller is done with the exchange whose ``result`` it holds: unless the stream
        ended well, a response not read to its end is dropped with its connection (SGLang
        aborts a request whose client went away). After a good end the connection waits
        for the response's last bytes, then serves another call (or closes)."""
        if result is not self.result:
            return  # that exchange is over, and its connection serves another call
        if result.done() and not result.cancelled() and result.exception() is None:
            return
        if not result.done():
            result.cancel()
        if not self.ended:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _end(self, status: int | BaseException) -> None:
        fut = self.result
        if fut is None or fut.done():
            return
        if isinstance(status, BaseException):
            fut.set_exception(status)
            self.close()
        else:
            fut.set_result(status)

    # ---- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.ended:  # bytes with no exchange under way: not ours to read
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._end(ValueError(f"not an HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self._late is not None:
            self._late.cancel()
        if not self.ended:
            if self.status not in (0, 200):  # an error's body, ended by the close
                self._end(self.status)
            why = f": {exc}" if exc else ""
            self._end(ConnectionResetError(f"the server closed the connection{why}"))

    # ---- httptools' callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.body += body
            return
        result = self.result
        if result is None or result.done():
            return  # past "[DONE]" (or hung up): nothing more is read
        for payload in self.sse.feed(body):
            if payload == b"[DONE]":
                self._end(200)
                self._late = asyncio.get_running_loop().call_later(AFTER_DONE_S, self._too_late)
                return
            try:
                self.on_event(payload)
            except Exception as e:  # noqa: BLE001 - an event the bridge cannot read: the call's
                self._end(e)
                return

    def on_message_complete(self) -> None:
        self.ended = True
        if self._late is not None:
            self._late.cancel()
        self._end(self.status)
        if not self.closed and self.parser.should_keep_alive():
            self.pool.release(self)
        else:
            self.close()

    def _too_late(self) -> None:
        if not self.ended:
            self.close()


class Pool:
    """The connections of one bridge to its server, and its ``POST /generate`` request."""

    def __init__(self, url: str, headers: dict[str, str], connect_timeout_s: float = 10.0):
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.path = (u.path.rstrip("/") + "/generate").encode()
        host = u.netloc.rpartition("@")[2]
        head = [f"Host: {host}", "Content-Type: application/json", "Accept: text/event-stream"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self._head = ("\r\n".join(head) + "\r\n").encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self.idle: list[Call] = []

    async def post(self, body: bytes, on_event: Callable[[bytes], None]) -> Call:
        """Send ``body`` to ``/generate`` on an idle connection, else a new one; each event's
        payload (``data:``) goes to ``on_event`` as it arrives (``Call.result``: the end)."""
        call = None
        now = time.monotonic()
        while self.idle:
            c = self.idle.pop()
            if not c.closed and now - c.idle_since < IDLE_REUSE_S:
                call = c
                break
            c.close()
        if call is None:
            loop = asyncio.get_running_loop()
            _, call = await asyncio.wait_for(
                loop.create_connection(lambda: Call(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s,
            )
        length = b"Content-Length: %d\r\n\r\n" % len(body)
        call.start(b"POST " + self.path + b" HTTP/1.1\r\n" + self._head + length + body, on_event)
        return call

    def release(self, call: Call) -> None:
        if len(self.idle) >= MAX_IDLE:
            call.close()
            return
        call.idle_since = time.monotonic()
        self.idle.append(call)

    def forget(self, call: Call) -> None:
        if call in self.idle:
            self.idle.remove(call)

    def close(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()


__all__ = ["Call", "Pool"]
