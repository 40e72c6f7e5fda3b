"""The load-test client's side of one call: SGLang's native ``/generate`` over HTTP/SSE, and
what it observed (``CallRecord``), in the simulator's record and event form.

Every call is SGLang's native ``POST /generate`` with ``input_ids``, greedy decoding and
``ignore_eos`` (exactly ``max_new_tokens`` tokens: the programs fixed every length up front)
and ``stream: true``; the client id travels three ways (the ``X-Client-Id`` header,
``routing_key``, and an optional per-client ``Authorization: Bearer`` key), so a fair server
can attribute the call whichever it reads and a plain SGLang server ignores what it does not
know.

What the client observes becomes the simulator's records: a PREFILL ``ServiceEvent`` at the
first output token (``extend_len = prompt_tokens - cached_tokens``: the server says what it
found cached) and a DECODE event per streamed chunk for the tokens it added. Admission is not
observable from outside, so ``admit_s`` is the first-token time; the time the call waited in
the server's queue is what the server says in ``meta_info.queue_time`` (sgl-fair and SGLang
both send it), kept as ``queue_s`` (None from a server that does not).

A non-2xx status, an ``abort`` finish, a server error chunk or a stream that ends unfinished
raises ``CallFailed``; the run loop (``harness``) turns that, transport errors and timeouts
into a failed call.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec

from sgl_fair.records import EventKind, RequestRecord, ServiceEvent
from sgl_fair.request import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S, Request, ServiceClass

# Streamed chunks repeat every output id so far: msgspec decodes (and type-checks) them in C,
# several times faster than json, which keeps the load generator's own CPU out of the
# latencies it measures.
_encode = msgspec.json.Encoder().encode

# A streamed line holds the cumulative output ids and text: allow long outputs (aiohttp's
# default read buffer would fail a line over 128 KiB).
READ_BUFSIZE = 1 << 22


# An idle pooled connection is dropped after this long, before any server closes it: sgl-fair
# closes one ``--http-header-timeout`` (10 s) after its last response, SGLang (uvicorn) after
# 5 s. aiohttp's default, 15 s, outlived both: a call then went out on a connection the server
# was closing, and was reset (issue 31: 83-99 calls per ``make demo`` on a loaded CPU).
KEEPALIVE_S = 3.0
# A call reset on a reused connection before any response byte is sent again, this many times
# at most (``send_call``).
STALE_RETRIES = 2
# After ``[DONE]`` the stream's end (chunked encoding's last chunk) is read, this long at
# most: a connection released before its response's end is closed, not pooled.
DRAIN_S = 1.0
_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})
# aiohttp's ClientConnectionResetError (>= 3.10) is a ConnectionResetError
_CLOSED = (aiohttp.ServerDisconnectedError, ConnectionResetError, BrokenPipeError)


async def _on_reuse(session: Any, ctx: SimpleNamespace, params: Any) -> None:
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


def open_session(
    *,
    max_connections: int,
    call_timeout_s: float,
    connect_timeout_s: float,
    keepalive_s: float = KEEPALIVE_S,
) -> aiohttp.ClientSession:
    """The run's HTTP session: ``max_connections`` 0 is no pool limit, ``call_timeout_s``
    bounds a whole call (its stream included), an idle connection is kept ``keepalive_s``.
    It tells ``send_call`` which calls went out on a reused connection."""
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, keepalive_timeout=keepalive_s
    )
    timeout = aiohttp.ClientTimeout(total=call_timeout_s, sock_connect=connect_timeout_s)
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=READ_BUFSIZE, trace_configs=[trace]
    )


def _stale_connection(e: BaseException) -> bool:
    """The error a call meets on a connection the server had closed: closed or reset before
    the response head, the request body's write included ("Can not write request body", its
    cause a reset); a refused or timed-out connect is not one."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return False
    seen: BaseException | None = e
    for _ in range(4):  # the error, then what caused it
        if seen is None:
            return False
        if isinstance(seen, _CLOSED):
            return True
        if isinstance(seen, OSError) and seen.errno in _STALE_ERRNOS:
            return True
        seen = seen.__cause__
    return False


async def _post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict, rec: CallRecord
) -> aiohttp.ClientResponse:
    """POST, sent again (same body, same rid) when it met a stale pooled connection.

    A retry needs all of: the connection was reused from the pool (``open_session``'s trace
    says so), the server closed or reset it before any byte of the response head, and the
    error is a closed connection (``_stale_connection``). That is the keep-alive race: a server
    closes an idle connection only while no request is in flight on it (uvicorn's keep-alive
    timer, sgl-fair's header timer and its connection cap alike), so the call never reached
    the application. Anything else fails the call: a fresh connection that closes, a response
    that breaks off, a timeout. And were the call already in flight there after all, the retry
    carries the same rid, which sgl-fair refuses while that rid is in flight (HTTP 400)."""
    for attempt in range(STALE_RETRIES + 1):
        trace: dict[str, bool] = {"reused": False}
        try:
            return await session.post(url, data=body, headers=headers, trace_request_ctx=trace)
        except aiohttp.ClientError as e:
            if attempt == STALE_RETRIES or not (trace["reused"] and _stale_connection(e)):
                raise
            rec.retries += 1
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# One call


@dataclass
class CallRecord:
    """Everything observed about one call (a line of ``requests.jsonl``).

    ``state``: ``unsent`` (cut off while waiting for its arrival time), ``in_flight``
    (transient), ``ok``, ``failed`` or ``unfinished`` (cut off mid-call at the drain end).
    ``chunk_s[i]`` is when the i-th chunk that added tokens arrived and ``chunk_tokens[i]``
    the output tokens received by then (cumulative). ``finish_s``: the final chunk of an
    ``ok`` call; ``failed_s``: when a failed call was given up. ``retries``: times it was sent
    again after meeting a pooled connection the server had closed (``send_call``).
    """

    rid: str
    wire_rid: str
    client: str
    program_id: str
    node: str
    app: str
    stage: int
    input_len: int
    max_new_tokens: int
    arrival_s: float
    state: str = "unsent"
    send_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    failed_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    queue_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    retries: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft_s"] = self.ttft_s
        return d

    def record(self) -> RequestRecord:
        """The simulator's record of this call (only sent calls have one)."""
        failed = self.state == "failed"
        return RequestRecord.build(
            rid=self.rid,
            client=self.client,
            arrival_s=self.arrival_s,
            input_len=self.input_len,
            output_len=self.max_new_tokens,
            output_ids=self.output_ids,
            prefix_len=self.cached_tokens,
            admit_s=self.first_token_s,  # admission is not observable from outside
            first_token_s=self.first_token_s,
            finish_s=self.finish_s if self.state == "ok" else None,
            rejected=failed,
            reject_reason=self.error if failed else None,
            interaction_id=self.program_id,
            app=self.app,
        )

    def events(self) -> list[ServiceEvent]:
        """PREFILL at the first token, then one DECODE per chunk that added tokens."""
        if self.first_token_s is None:
            return []
        input_len = self.prompt_tokens if self.prompt_tokens else self.input_len
        cached = min(max(self.cached_tokens or 0, 0), input_len)
        out = [
            ServiceEvent(
                self.first_token_s,
                self.client,
                self.rid,
                EventKind.PREFILL,
                input_len,
                extend_len=input_len - cached,
            )
        ]
        prev = 0
        for t, n in zip(self.chunk_s, self.chunk_tokens, strict=True):
            if n > prev:
                out.append(
                    ServiceEvent(
                        t, self.client, self.rid, EventKind.DECODE, input_len, start=prev, end=n
                    )
                )
                prev = n
        return out


class CallFailed(Exception):
    """The server answered, but not with a complete generation (message: why)."""


def _finish_type(reason: Any) -> str:
    if isinstance(reason, Mapping):
        return str(reason.get("type") or "unknown")
    return str(reason)


class _Meta(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    queue_time: float | None = None
    finish_reason: Any = None


class StreamChunk(msgspec.Struct):
    """The fields of a streamed ``/generate`` chunk the harness reads (others are skipped
    while decoding, ``text`` included: it is never needed)."""

    output_ids: list[int] | None = None
    meta_info: _Meta | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(StreamChunk).decode


def decode_chunk(data: str | bytes) -> StreamChunk:
    """One SSE ``data:`` payload; ``CallFailed`` if it is not a chunk object."""
    try:
        return _decode_chunk(data)
    except msgspec.DecodeError:  # ValidationError included
        raise CallFailed(f"bad SSE chunk: {str(data)[:200]}") from None


def apply_chunk(rec: CallRecord, chunk: StreamChunk | Mapping[str, Any], t: float) -> bool:
    """Fold one streamed chunk into ``rec``; True once it carried the finish reason.

    ``output_ids`` are cumulative in SGLang's default mode and only the new ids with
    ``--incremental-streaming-output``; ``meta_info.completion_tokens`` (always cumulative)
    tells which. Raises ``CallFailed`` on an error chunk or an ``abort`` finish.
    """
    if not isinstance(chunk, StreamChunk):
        try:
            chunk = msgspec.convert(chunk, StreamChunk)
        except msgspec.ValidationError as e:
            raise CallFailed(f"bad chunk: {e}: {str(chunk)[:200]}") from None
    if chunk.error:
        err = chunk.error
        msg = err.get("message", err) if isinstance(err, Mapping) else err
        raise CallFailed(f"server error: {str(msg)[:300]}")
    meta = chunk.meta_info or _Meta()
    completion = meta.completion_tokens
    ids = chunk.output_ids
    if ids is not None:
        incremental = (
            completion is not None
            and len(ids) != completion
            and len(rec.output_ids) + len(ids) == completion
        )
        rec.output_ids = rec.output_ids + ids if incremental else ids
    if completion is not None:
        rec.completion_tokens = completion
    if meta.prompt_tokens is not None:
        rec.prompt_tokens = meta.prompt_tokens
    if meta.cached_tokens is not None:
        rec.cached_tokens = meta.cached_tokens
    if meta.queue_time is not None and meta.queue_time >= 0:
        rec.queue_s = meta.queue_time
    n = len(rec.output_ids)
    if n > (rec.chunk_tokens[-1] if rec.chunk_tokens else 0):
        rec.chunk_s.append(t)
        rec.chunk_tokens.append(n)
        if rec.first_token_s is None:
            rec.first_token_s = t
    reason = meta.finish_reason
    if reason is None:
        return False
    rec.finish_reason = _finish_type(reason)
    rec.finish_s = t
    if rec.finish_reason == "abort":
        msg = reason.get("message") if isinstance(reason, Mapping) else None
        raise CallFailed(f"aborted by the server: {msg or reason}")
    return True


def request_payload(
    req: Request,
    wire_rid: str,
    *,
    routing_key: bool = True,
    stream_interval: int | None = None,
    interaction_prefix: str = "",
) -> dict[str, Any]:
    """SGLang's native ``/generate`` body: token ids in, exactly ``max_new_tokens`` out.

    A program's call says which interaction it belongs to, as the simulator's requests do
    (FairServe, ``docs/fairserve.md``): ``interaction_id`` (the program run, prefixed with
    ``interaction_prefix`` so runs do not share ids), ``app`` and ``stage``; and its service
    class when it is real-time (BROS)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": req.max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream_interval is not None:
        sampling["stream_interval"] = stream_interval
    payload: dict[str, Any] = {
        "input_ids": list(req.input_ids),
        "sampling_params": sampling,
        "stream": True,
        "rid": wire_rid,
    }
    if routing_key:
        payload["routing_key"] = req.client
    if req.interaction_id is not None:
        payload["interaction_id"] = interaction_prefix + req.interaction_id
    if req.app is not None:
        payload["app"] = req.app
        payload["stage"] = req.stage
    if req.service_class is not ServiceClass.BE:
        payload["priority_class"] = req.service_class.value
        if req.ttft_slo_s != DEFAULT_TTFT_SLO_S:
            payload["ttft_slo_s"] = req.ttft_slo_s
        if req.tpot_slo_s != DEFAULT_TPOT_SLO_S:
            payload["tpot_slo_s"] = req.tpot_slo_s
    return payload


async def send_call(
    session: aiohttp.ClientSession,
    url: str,
    req: Request,
    rec: CallRecord,
    now: Callable[[], float],
    *,
    api_key: str | None = None,
    routing_key: bool = True,
    stream_interval: int | None = None,
) -> None:
    """``POST {url}/generate`` for ``req``, folding every chunk into ``rec`` as it arrives
    (at ``now()``, the run's clock). A call that met a pooled connection the server had
    closed is sent again (``_post``). Raises ``CallFailed`` when the server answers with
    anything but a finished generation; transport errors and timeouts propagate."""
    headers = {"X-Client-Id": req.client, "Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    # the wire rid is the run's tag + the rid: the same tag keeps interactions apart
    tag = rec.wire_rid[: len(rec.wire_rid) - len(req.rid)] if rec.wire_rid.endswith(req.rid) else ""
    payload = request_payload(
        req,
        rec.wire_rid,
        routing_key=routing_key,
        stream_interval=stream_interval,
        interaction_prefix=tag,
    )
    body = _encode(payload)
    async with await _post(session, f"{url}/generate", body, headers, rec) as resp:
        rec.status = resp.status
        if not 200 <= resp.status < 300:
            text = (await resp.text(errors="replace")).strip().replace("\n", " ")
            raise CallFailed(f"HTTP {resp.status}: {text[:300]}")
        if resp.content_type == "application/json":  # a server that does not stream
            apply_chunk(rec, await resp.json(content_type=None), now())
            return
        finished = done = False
        async for raw in resp.content:  # one SSE line at a time, however TCP split it
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments (":"), event/id/retry fields
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            finished = apply_chunk(rec, decode_chunk(data), now()) or finished
        if done:
            await _drain(resp)
    if not finished:
        if not done:
            raise CallFailed("stream ended without a finish_reason or [DONE]")
        rec.finish_s = now()  # [DONE] without a finish_reason: judged by length


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read ``resp`` to its end (``DRAIN_S`` at most), so that its connection goes back to
    the pool: aiohttp closes a connection whose response was not read to the end, and the
    end of a stream comes after its ``[DONE]``, often in a later packet."""
    # a server that keeps streaming past [DONE]: its connection is not reused
    with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
        await asyncio.wait_for(resp.content.read(), DRAIN_S)


# ---------------------------------------------------------------------------------------------
# Server probe


class Unreachable(Exception):
    """The endpoint did not answer its health check."""


async def probe_server(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float = 5.0
) -> dict[str, Any]:
    """``GET /health`` (must be 2xx), then the server's info (``/server_info``, or SGLang's
    older ``/get_server_info``; ``{}`` when neither answers with a JSON object)."""
    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(f"{url}/health", timeout=timeout) as resp:
            if not 200 <= resp.status < 300:
                raise Unreachable(f"{url}/health answered HTTP {resp.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        why = str(e) or type(e).__name__
        raise Unreachable(f"{url}: {why}") from None
    for path in ("/server_info", "/get_server_info"):
        try:
            async with session.get(f"{url}{path}", timeout=timeout) as resp:
                if resp.status == 200:
                    info = await resp.json(content_type=None)
                    if isinstance(info, dict):
                        return info
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            continue
    return {}
