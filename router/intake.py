"""The HTTP front's intake, in front of the routes: a bounded queue, and bounded work per
event-loop pass. (Not the tenant limits, ``state.py``; not the cluster OIT's throttling,
``oit.py``; not a worker scheduler's admission.)

The router process is one asyncio loop: the HTTP front, the router and the sockets to the
workers share it. A burst of thousands of requests used to run every request's parse,
tokenization and dispatch in one pass of the loop (12–21 s for 8,000 prompts of 900
tokens); nothing else ran meanwhile — not the workers' heartbeats, not the streams.

``IntakeMiddleware`` (pure ASGI, wraps the whole app) does two things for the generation
endpoints, before any of that work:

1. **Bounded queue** (SGLang's ``--max-queued-requests``): while ``max_queued`` generation
   requests are already being served, another gets ``429`` with ``Retry-After`` at once,
   without its body being read. Memory stays bounded under any burst.
2. **Bounded work per pass** (``StartGate``): the body is read first (waiting on the network
   costs the loop nothing), then the request waits for its turn: at most ``per_pass``
   requests start their synchronous work (parse, tokenize, dispatch) in one pass of the
   loop; the rest start in the next passes, each of which begins by polling the sockets.
   So a pass stays short (``per_pass`` × a few ms) however large the burst.

Requests to other endpoints (health, metrics, info) pass straight through: they stay
responsive during a burst.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sgl_fair.router import protocol as P

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


class StartGate:
    """Lets at most ``per_pass`` callers through per pass of the event loop; the others wait,
    in arrival order, for the next passes."""

    def __init__(self, per_pass: int) -> None:
        if per_pass < 1:
            raise ValueError(f"per_pass must be >= 1 (got {per_pass})")
        self.per_pass = per_pass
        self._started = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._armed = False
        self.num_waited = 0  # callers that had to wait at least one pass

    async def turn(self) -> None:
        if self._started < self.per_pass and not self._waiters:
            self._started += 1
            self._arm()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.num_waited += 1
        self._arm()
        try:
            await fut
        except asyncio.CancelledError:
            if not fut.done():
                self._waiters.remove(fut)
            raise

    def _arm(self) -> None:
        # call_soon runs in the *next* pass, which first polls the sockets (with a zero
        # timeout, since it has work ready): I/O gets its turn between two batches.
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        self._armed = False
        self._started = 0
        while self._waiters and self._started < self.per_pass:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._started += 1
        if self._waiters or self._started:
            self._arm()


class IntakeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_queued: int | None,
        per_pass: int = 16,
        max_body_bytes: int = 16 << 20,
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.max_queued = max_queued
        self.gate = StartGate(per_pass)
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject
        self.num_active = 0  # generation requests being served (body read .. response sent)
        self.num_rejected = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.max_queued is not None and self.num_active >= self.max_queued:
            self.num_rejected += 1
            if self.on_reject is not None:
                self.on_reject()
            await _reject(send, self.num_active)
            return
        self.num_active += 1
        try:
            messages = await _read_body(receive, self.max_body_bytes)
            await self.gate.turn()
            await self.app(scope, _replay(messages, receive), send)
        finally:
            self.num_active -= 1


async def _read_body(receive: Receive, limit: int) -> list[Message]:
    """The request's body messages, read up to ``limit + 1`` bytes (the route itself answers
    413 past ``limit``; reading more would only buffer what it refuses)."""
    messages: list[Message] = []
    size = 0
    while True:
        msg = await receive()
        messages.append(msg)
        if msg["type"] != "http.request":
            return messages  # disconnected: the route sees it
        size += len(msg.get("body", b""))
        if not msg.get("more_body", False) or size > limit:
            return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = collections.deque(messages)

    async def replayed() -> Message:
        if pending:
            return pending.popleft()
        return await receive()  # after the body: disconnect notices

    return replayed


async def _reject(send: Send, num_active: int) -> None:
    err = P.ProtocolError(
        429,
        f"the server is full: {num_active} requests are queued (--max-queued-requests); "
        "retry later",
        None,
        retry_after_s=1.0,
    )
    body = err.body()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
