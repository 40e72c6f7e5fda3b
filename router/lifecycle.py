"""A request's life in the HTTP front, from start to end: the routes' side of its
:class:`Generation` s (one per prompt and sample, ``router/generation.py``).

:func:`prepare` turns a parsed request's items into started generations (identify,
tokenize, check the tenant's limits, submit); :func:`until_done` waits for them all and
raises the first failure; :func:`first_events` holds a stream's status line until each
generation has its first token or its refusal; :func:`merged_updates` interleaves parallel
samples. Nothing is lost: a client that disconnects has its generations aborted on the
worker (freeing their KV), and a tenant's in-flight count is given back however a request
ends (:func:`done_all`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest

from sgl_fair.router import protocol as P
from sgl_fair.router.generation import Generation, expand_samples
from sgl_fair.router.service import NoWorkerError
from sgl_fair.router.state import Identity, ServerState


def start_all(state: ServerState, gens: list[Generation], who: Identity) -> None:
    started: list[Generation] = []
    try:
        for g in gens:
            if g.item.rid is not None and g.item.rid in state.service.calls:
                raise P.ProtocolError(400, f"rid {g.item.rid!r} is already in flight", "rid")
            if g.lead is not None:
                continue  # a later sample: submitted once its lead has prefilled
            g.start()
            started.append(g)
    except NoWorkerError as e:
        for g in started:
            g.abort("no worker")
        raise P.ProtocolError(
            503, f"no worker available: {e}", None, retry_after_s=e.retry_after_s
        ) from None
    except P.ProtocolError:
        for g in started:
            g.abort("batch refused")
        raise
    for g in gens:
        if g.lead is not None:
            g._starter = asyncio.ensure_future(g.start_after_lead())
    key = who.tenant.name if who.tenant is not None else None
    if key is not None:
        state.inflight[key] = state.inflight.get(key, 0) + len(gens)


def done_all(state: ServerState, gens: list[Generation], who: Identity) -> None:
    key = who.tenant.name if who.tenant is not None else None
    if key is not None:
        state.inflight[key] = max(0, state.inflight.get(key, 0) - len(gens))


async def run_to_end(request: HTTPRequest, gens: list[Generation]) -> None:
    """Wait for every generation; abort them all if the client goes away."""

    async def one(g: Generation) -> None:
        async for _ in g.updates():
            pass

    task = asyncio.gather(*(one(g) for g in gens))
    try:
        if not await _done_unless_gone(request, task):
            for g in gens:
                g.abort("client disconnected")
            await task
    except asyncio.CancelledError:
        for g in gens:
            g.abort("client disconnected")
        raise


async def _done_unless_gone(request: HTTPRequest, task: asyncio.Future) -> bool:
    """Wait for ``task``: True once it is done (raising what it raised), False as soon as
    the client disconnects (checked every second)."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            task.result()
            return True
        if await request.is_disconnected():
            return False


def prepare(
    state: ServerState,
    request: HTTPRequest,
    items: list[Any],
    param: str,
    user: str | None,
    *,
    chat: bool = False,
) -> tuple[Identity, list[Generation]]:
    """Identify, tokenize, check the tenant's limits and submit: one started
    :class:`Generation` per prompt and sample (``n`` > 1 gives ``n`` per prompt, in order;
    the tenant's limits count them all)."""
    who = state.identify(request, user, items[0].routing_key)
    sched = state.scheduling(request, items[0].hints, who)
    total = sum(it.sampling.n for it in items)
    if total > state.limits.max_batch:
        raise P.ProtocolError(
            400, f"{total} generations (prompts x n) exceed the limit of "
            f"{state.limits.max_batch}", "n",
        )  # fmt: skip
    gens = []
    for it in items:
        ids, max_new = state.tokenize(it, param, who, chat=chat)
        lead = None
        for sample in expand_samples([it]):
            g = Generation(state, sample, ids, max_new, who, sched)
            g.lead = lead
            lead = lead or g
            gens.append(g)
    state.check_tenant_limits(who, len(gens))
    start_all(state, gens, who)
    return who, gens


async def first_events(
    state: ServerState, request: HTTPRequest, gens: list[Generation], who: Identity
) -> None:
    """A streaming response, before its status line: wait until every submitted generation
    has its first token or has ended, so one refused before any token (a FairServe throttle,
    a rejection, no worker) is answered with its HTTP status (429, 400, 503), not a 200
    stream carrying an error. Raises that error (the request's generations aborted and its
    in-flight count given back), or 499 when the client went away meanwhile."""

    async def first(g: Generation) -> None:
        await g.submitted.wait()
        if g.call is not None:
            await g.call.updated.wait()  # set by the first Tokens or by the end; not cleared

    leads = [g for g in gens if g.lead is None]
    task = asyncio.gather(*(first(g) for g in leads))
    try:
        gone = not await _done_unless_gone(request, task)
        if gone:
            task.cancel()
    except BaseException:
        task.cancel()
        _give_up(state, gens, who, "client disconnected")
        raise
    if gone:
        _give_up(state, gens, who, "client disconnected")
        raise P.ProtocolError(499, "the client disconnected before the first token", None)
    for g in leads:
        err = g.failed
        if err is not None and not (g.call is not None and g.call.tokens):
            _give_up(state, gens, who, "a generation of the request failed")
            raise err


def _give_up(state: ServerState, gens: list[Generation], who: Identity, why: str) -> None:
    for g in gens:
        g.abort(why)
    done_all(state, gens, who)


def check_failed(gens: list[Generation]) -> None:
    for g in gens:
        err = g.failed
        if err is not None:
            raise err


async def until_done(
    state: ServerState, request: HTTPRequest, gens: list[Generation], who: Identity
) -> None:
    """A non-streaming response: wait for every generation, raise the first failure."""
    try:
        await run_to_end(request, gens)
    finally:
        done_all(state, gens, who)
    check_failed(gens)


async def merged_updates(gens: list[Generation]) -> AsyncIterator[tuple[int, str | None]]:
    """The text deltas of several generations as they arrive, ``(index, delta)``, and
    ``(index, None)`` once generation ``index`` has finished (parallel samples streamed
    together; SGLang's and OpenAI's chunks carry the ``index``)."""
    if len(gens) == 1:
        async for delta in gens[0].updates():
            yield 0, delta
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, str | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for delta in g.updates():
                queue.put_nowait((i, delta, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    left = len(gens)
    try:
        while left:
            i, delta, err = await queue.get()
            if err is not None:
                raise err
            if delta is None:
                left -= 1
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()
