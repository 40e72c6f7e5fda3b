"""Live load generator: plays the programs' calls against an SGLang-compatible HTTP server.

The simulated experiments (``cluster_runs``) drive programs through a virtual cluster; this
module drives the *same* programs through a real server, so a live run and a simulated run of
one workload are measured by the same code (``metrics.summarize``, the cluster row fields)::

    workload(...) ─▶ generate_programs ─▶ drive(programs, HarnessConfig) ─▶ HarnessResult
                                                                             │ records()/events()
                                                   harness_row / fairness_table ◀┘

Closed loop, as the simulator: a program starts at its ``start_s`` (wall-clock seconds from
the run's start), its root calls are sent then; a child call is built only when all its
parents finished, from their *actual* output ids (``req.output_ids`` is set before
``program.on_finished``), and a call with ``arrival_s`` in the future (a chat user's think
time) waits until then. Every call is SGLang's native ``POST /generate`` with ``input_ids``,
greedy decoding and ``ignore_eos`` (exactly ``max_new_tokens`` tokens: the programs fixed
every length up front) and ``stream: true``; the client id travels three ways (the
``X-Client-Id`` header, ``routing_key``, and an optional per-client ``Authorization: Bearer``
key), so a fair server can attribute the call whichever it reads and a plain SGLang server
ignores what it does not know.

What the client observes becomes the simulator's records: a PREFILL ``ServiceEvent`` at the
first output token (``extend_len = prompt_tokens - cached_tokens``: the server says what it
found cached) and a DECODE event per streamed chunk for the tokens it added. Admission is not
observable from outside, so ``admit_s`` is the first-token time.

Failures are counted, never dropped: a non-2xx status, an ``abort`` finish, a server error
chunk, a short output, a transport error or a timeout fails the call (``state = "failed"``,
the record ``rejected`` with the error as ``reject_reason``) and ``program.on_failed`` stops
its program. Arrivals stop at ``duration_s``; in-flight programs then drain for up to
``drain_timeout_s`` and whatever is left is cancelled and reported as unfinished (a
cancelled stream makes SGLang abort the request server-side).

Times are ``loop.time()`` (monotonic) relative to the run's start; ``arrival_s`` is when the
program wanted the call sent, ``send_s`` when it was (their gap is the harness's own lag,
reported as ``max_send_lag_s``, so an overloaded load generator is visible rather than
silently lowering the offered load).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp
import msgspec

from sgl_fair import metrics
from sgl_fair.records import EventKind, RequestRecord, ServiceEvent
from sgl_fair.request import Request

from .combos import label_of
from .program_metrics import ACTUAL, PERCEIVED, client_latencies, service_series
from .program_metrics import well_behaved_latency_of as _wb_latency
from .programs import BASE_RATE_PER_S, Program, ProgramClient, workload

# Streamed chunks repeat every output id so far: msgspec decodes (and type-checks) them in C,
# several times faster than json, which keeps the load generator's own CPU out of the
# latencies it measures.
_encode = msgspec.json.Encoder().encode

# A streamed line holds the cumulative output ids and text: allow long outputs (aiohttp's
# default read buffer would fail a line over 128 KiB).
READ_BUFSIZE = 1 << 22


def default_drain_timeout(duration_s: float) -> float:
    """Long enough for programs started near the end to finish at a normal load (a ToT tree
    is several sequential calls), without letting an overloaded server stall the run for as
    long as it ran again many times over."""
    return max(30.0, float(duration_s))


@dataclass(frozen=True)
class HarnessConfig:
    """How to drive one endpoint.

    ``api_keys``: client id → API key, sent as ``Authorization: Bearer``. ``run_tag``
    prefixes every wire ``rid`` (``f"{run_tag}-{rid}"``) so runs against one long-lived server
    never reuse an id; empty draws one. ``max_connections`` 0 means no pool limit (closed-loop
    programs need one connection per in-flight call; a cap would queue calls in the client
    and hide the server's scheduling). ``stream_interval``: SGLang's sampling parameter (a
    chunk every N tokens; the server's default when None): one Python client parses ~10k
    chunks/s per core, so a large fleet streaming every token can saturate it (watch
    ``max_loop_lag_s``).
    """

    url: str
    duration_s: float
    drain_timeout_s: float | None = None
    call_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    api_keys: Mapping[str, str] = field(default_factory=dict)
    run_tag: str = ""
    routing_key: bool = True
    max_connections: int = 0
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.run_tag:
            object.__setattr__(self, "run_tag", f"lt{int(time.time())}{secrets.token_hex(2)}")
        for name in ("duration_s", "call_timeout_s", "connect_timeout_s"):
            _need_positive(name, getattr(self, name))
        if self.drain_timeout_s is not None:
            _need_positive("drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise ValueError(f"field 'stream_interval' must be an integer >= 1 (got {si!r})")

    @property
    def drain_s(self) -> float:
        if self.drain_timeout_s is None:
            return default_drain_timeout(self.duration_s)
        return float(self.drain_timeout_s)


def _need_positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"field {name!r} must be a number {'>=' if allow_zero else '>'} 0")


# ---------------------------------------------------------------------------------------------
# One call


@dataclass
class CallRecord:
    """Everything observed about one call (a line of ``requests.jsonl``).

    ``state``: ``unsent`` (cut off while waiting for its arrival time), ``in_flight``
    (transient), ``ok``, ``failed`` or ``unfinished`` (cut off mid-call at the drain end).
    ``chunk_s[i]`` is when the i-th chunk that added tokens arrived and ``chunk_tokens[i]``
    the output tokens received by then (cumulative). ``finish_s``: the final chunk of an
    ``ok`` call; ``failed_s``: when a failed call was given up.
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
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft_s"] = self.ttft_s
        return d

    def record(self) -> RequestRecord:
        """The simulator's record of this call (only sent calls have one)."""
        return RequestRecord(
            rid=self.rid,
            client=self.client,
            arrival_s=self.arrival_s,
            input_len=self.input_len,
            output_len=self.max_new_tokens,
            num_output=len(self.output_ids),
            prefix_len=self.cached_tokens or 0,
            admit_s=self.first_token_s,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s if self.state == "ok" else None,
            rejected=self.state == "failed",
            reject_reason=self.error if self.state == "failed" else None,
            num_retractions=0,
            service_class="be",
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
    req: Request, wire_rid: str, *, routing_key: bool = True, stream_interval: int | None = None
) -> dict[str, Any]:
    """SGLang's native ``/generate`` body: token ids in, exactly ``max_new_tokens`` out."""
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
    return payload


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class HarnessStats:
    """A progress snapshot (what the CLI's progress bar shows)."""

    elapsed_s: float = 0.0
    duration_s: float = 0.0
    draining: bool = False
    programs_total: int = 0
    programs_started: int = 0
    programs_done: int = 0
    programs_failed: int = 0
    calls_ok: int = 0
    calls_failed: int = 0
    calls_in_flight: int = 0
    max_loop_lag_s: float = 0.0


@dataclass
class HarnessResult:
    """A finished run: the programs (their state at the end), every issued call, the end.

    ``t_end_s``: when the run stopped (everything drained, or the cut-off), relative to the
    start; ``started_at``: the start as a Unix time; ``stopped``: cut short by ``stop()``
    (Ctrl-C) rather than by the drain timeout or completion. ``max_loop_lag_s``: the
    longest the harness's event loop was late to a timer; beyond ~0.1 s the client was
    CPU-bound and every time it recorded is late by up to that much.
    """

    programs: list[Program]
    calls: list[CallRecord]
    t_end_s: float
    started_at: float
    duration_s: float
    drain_timeout_s: float
    stopped: bool = False
    max_loop_lag_s: float = 0.0

    @property
    def sent(self) -> list[CallRecord]:
        return [c for c in self.calls if c.send_s is not None]

    def records(self) -> list[RequestRecord]:
        return [c.record() for c in self.sent]

    def events(self) -> list[ServiceEvent]:
        evs = [e for c in self.calls for e in c.events()]
        evs.sort(key=lambda e: e.t_s)
        return evs

    def count(self, state: str) -> int:
        return sum(c.state == state for c in self.calls)

    @property
    def started_programs(self) -> list[Program]:
        return [p for p in self.programs if p.num_issued > 0]

    @property
    def latency_programs(self) -> list[Program]:
        """The programs latency percentiles are over: started and not failed. A failed
        program has no latency (it is counted as failed), as a failed call has no TTFT;
        one still running at the cut-off counts with its age then (a lower bound)."""
        return [p for p in self.programs if p.num_issued > 0 and not p.failed]

    def errors(self) -> Counter[str]:
        return Counter(c.error or "?" for c in self.calls if c.state == "failed")


class _Run:
    """The event-loop side of ``drive``: one task per call; all program state is touched only
    from the loop's thread, so the programs need no locks."""

    def __init__(
        self,
        programs: Sequence[Program],
        config: HarnessConfig,
        session: aiohttp.ClientSession,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.programs = list(programs)
        self.config = config
        self.session = session
        self.calls: list[CallRecord] = []
        self.tasks: set[asyncio.Task] = set()
        self.stats = HarnessStats(duration_s=config.duration_s, programs_total=len(self.programs))
        self.stop_event = asyncio.Event()
        self.idle = asyncio.Event()  # set whenever no call task is left
        self.t0 = self.loop.time()

    def now(self) -> float:
        return self.loop.time() - self.t0

    # ---- issuing ----

    def _spawn(self, prog: Program, req: Request) -> None:
        node = req.rid.split("/", 1)[1] if "/" in req.rid else req.rid
        rec = CallRecord(
            rid=req.rid,
            wire_rid=f"{self.config.run_tag}-{req.rid}",
            client=req.client,
            program_id=prog.program_id,
            node=node,
            app=req.app or prog.kind,
            stage=req.stage,
            input_len=req.input_len,
            max_new_tokens=int(req.max_new_tokens or req.output_len),
            arrival_s=req.arrival_s,
        )
        self.calls.append(rec)
        task = self.loop.create_task(self._call(prog, req, rec))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self.idle.set()

    async def _launch(self) -> None:
        for prog in self.programs:
            if self.stop_event.is_set():
                return
            delay = prog.start_s - self.now()
            if delay > 0 and await self._sleep_or_stop(delay):
                return
            self.stats.programs_started += 1
            # The scheduled start, not "now": a lagging harness shows up as latency.
            for req in prog.start(prog.start_s):
                self._spawn(prog, req)

    async def _sleep_or_stop(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; True if ``stop()`` came first."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), delay)
        except asyncio.TimeoutError:
            return False
        return True

    # ---- one call ----

    async def _call(self, prog: Program, req: Request, rec: CallRecord) -> None:
        wait = req.arrival_s - self.now()
        if wait > 0:
            await asyncio.sleep(wait)  # a cancellation here leaves it "unsent"
        rec.send_s = self.now()
        rec.state = "in_flight"
        self.stats.calls_in_flight += 1
        error: str | None = None
        try:
            await self._send(req, rec)
        except asyncio.CancelledError:
            rec.state = "unfinished"
            raise
        except CallFailed as e:
            error = str(e)
        except asyncio.TimeoutError:
            error = f"timeout: no complete response within {self.config.call_timeout_s:g} s"
        except aiohttp.ClientError as e:
            error = f"transport error: {type(e).__name__}: {e}"
        except Exception as e:  # a malformed response must fail the call, not the run
            error = f"{type(e).__name__}: {e}"
        finally:
            self.stats.calls_in_flight -= 1
        if error is None and len(rec.output_ids) != req.output_len:
            if rec.completion_tokens and not rec.output_ids:
                error = f"the response carries no output_ids ({rec.completion_tokens} tokens)"
            else:
                error = (
                    f"short output: {len(rec.output_ids)} of {req.output_len} tokens "
                    f"(finish_reason {rec.finish_reason})"
                )
        now = self.now()
        if error is not None:
            rec.state, rec.error, rec.failed_s = "failed", error, now
            rec.finish_s = None
            self.stats.calls_failed += 1
            prog.on_failed(req, now)
            if prog.done:
                self.stats.programs_failed += 1
            return
        rec.state = "ok"
        self.stats.calls_ok += 1
        req.output_ids = list(rec.output_ids)  # children's prompts are built from these
        children = prog.on_finished(req, now)
        if prog.done:
            if prog.failed:
                self.stats.programs_failed += 1
            else:
                self.stats.programs_done += 1
        for child in children:
            self._spawn(prog, child)

    async def _send(self, req: Request, rec: CallRecord) -> None:
        cfg = self.config
        headers = {"X-Client-Id": req.client, "Content-Type": "application/json"}
        key = cfg.api_keys.get(req.client)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        payload = request_payload(
            req, rec.wire_rid, routing_key=cfg.routing_key, stream_interval=cfg.stream_interval
        )
        body = _encode(payload)
        async with self.session.post(f"{cfg.url}/generate", data=body, headers=headers) as resp:
            rec.status = resp.status
            if not 200 <= resp.status < 300:
                text = (await resp.text(errors="replace")).strip().replace("\n", " ")
                raise CallFailed(f"HTTP {resp.status}: {text[:300]}")
            if resp.content_type == "application/json":  # a server that does not stream
                apply_chunk(rec, await resp.json(content_type=None), self.now())
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
                finished = apply_chunk(rec, decode_chunk(data), self.now()) or finished
        if not finished:
            if not done:
                raise CallFailed("stream ended without a finish_reason or [DONE]")
            rec.finish_s = self.now()  # [DONE] without a finish_reason: judged by length

    # ---- the whole run ----

    def stop(self) -> None:
        """Stop issuing and draining now (Ctrl-C): what is in flight is cancelled."""
        self.stop_event.set()

    async def _ticker(
        self, on_update: Callable[[HarnessStats], None] | None, every_s: float
    ) -> None:
        """Progress updates, and the loop's lag: how late a timer fires."""
        while True:
            self.stats.elapsed_s = self.now()
            if on_update is not None:
                on_update(self.stats)
            due = self.loop.time() + every_s
            await asyncio.sleep(every_s)
            lag = self.loop.time() - due
            self.stats.max_loop_lag_s = max(self.stats.max_loop_lag_s, lag)

    async def run(
        self, on_update: Callable[[HarnessStats], None] | None, update_every_s: float
    ) -> float:
        ticker = self.loop.create_task(self._ticker(on_update, update_every_s))
        try:
            await self._launch()
            deadline = max(self.now(), self.config.duration_s) + self.config.drain_s
            self.stats.draining = True
            # A child joins `tasks` before its parent's task ends, so once the launcher is done
            # `tasks` empties only when every started program is done.
            if self.tasks and not self.stop_event.is_set():
                self.idle.clear()
                waiters = {
                    self.loop.create_task(self.idle.wait()),
                    self.loop.create_task(self.stop_event.wait()),
                }
                left = max(0.0, deadline - self.now())
                await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
            t_end = self.now()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            return t_end
        finally:
            ticker.cancel()
            self.stats.elapsed_s = self.now()
            if on_update is not None:
                on_update(self.stats)


async def drive(
    programs: Sequence[Program],
    config: HarnessConfig,
    *,
    on_update: Callable[[HarnessStats], None] | None = None,
    update_every_s: float = 0.25,
    on_start: Callable[[Callable[[], None]], None] | None = None,
) -> HarnessResult:
    """Run ``programs`` (start times relative to now) against ``config.url``.

    ``on_update`` gets a ``HarnessStats`` every ``update_every_s``; ``on_start`` gets a
    ``stop()`` callable (e.g. to wire Ctrl-C to a clean cut-off that still reports).
    """
    for p in programs:
        if p.num_issued:
            raise ValueError(f"program {p.program_id!r} was already started")
    programs = sorted(programs, key=lambda p: p.start_s)
    connector = aiohttp.TCPConnector(limit=config.max_connections, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(
        total=config.call_timeout_s, sock_connect=config.connect_timeout_s
    )
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=READ_BUFSIZE
    ) as session:
        run = _Run(programs, config, session)
        if on_start is not None:
            on_start(run.stop)
        started_at = time.time()
        t_end = await run.run(on_update, update_every_s)
    return HarnessResult(
        programs=programs,
        calls=run.calls,
        t_end_s=t_end,
        started_at=started_at,
        duration_s=config.duration_s,
        drain_timeout_s=config.drain_s,
        stopped=run.stop_event.is_set(),
        max_loop_lag_s=run.stats.max_loop_lag_s,
    )


# ---------------------------------------------------------------------------------------------
# Server probes


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


def server_dp_size(info: Mapping[str, Any]) -> int | None:
    dp = info.get("dp_size")
    if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1:
        return dp
    return None


def server_policy(info: Mapping[str, Any]) -> dict[str, Any]:
    """The row's ``policy``/``router``/``local`` (+ opts) from what the server says.

    Our server reports ``router_policy`` and ``schedule_policy`` (the local policy, SGLang's
    flag name) with their ``*_opts``; a plain SGLang server has ``load_balance_method`` (its
    dp router) and ``schedule_policy``. The label is the cluster experiments' for the same
    pairing (e.g. ``D2LPM``), so live and simulated rows line up; else ``router+local``.
    """
    router = info.get("router_policy") or info.get("router") or info.get("load_balance_method")
    local = info.get("schedule_policy") or info.get("local_policy") or info.get("local")
    router = str(router) if router is not None else None
    local = str(local) if local is not None else None
    label = "+".join(x for x in (router, local) if x) or "unknown"
    label = label_of(router, local) or label

    def opts(key: str) -> dict[str, Any]:
        value = info.get(key)
        return dict(value) if isinstance(value, Mapping) else {}

    return {
        "policy": label,
        "router": router,
        "local": local,
        "router_opts": opts("router_policy_opts"),
        "local_opts": opts("schedule_policy_opts"),
    }


# ---------------------------------------------------------------------------------------------
# Workload clients at a given rate


def build_clients(
    name: str,
    scenario: str | None,
    *,
    num_clients: int,
    duration_s: float,
    dp: int = 1,
    rate_scale: float = 1.0,
    rate: float | None = None,
    params: Mapping[str, Any] | None = None,
) -> list[ProgramClient]:
    """``workload(...)``'s clients; ``rate`` (programs/s for a normal client) replaces
    ``BASE_RATE_PER_S[kind] × dp × rate_scale``, the scenario's misbehaver factors still
    applying on top. Built by asking ``workload`` per program kind for the ``rate_scale``
    that gives that kind ``rate`` (``mixed`` has one base rate per kind), so every other
    choice (arrival process, cv, misbehaviour) stays ``workload``'s. ``params`` override
    every client's program parameters (as ``RunSpec.params``)."""
    kw = {"num_clients": num_clients, "duration_s": duration_s}
    if rate is None:
        clients = workload(name, scenario, dp=dp, rate_scale=rate_scale, **kw)
    else:
        _need_positive("rate", rate)
        base = workload(name, scenario, **kw)
        clients = list(base)
        for kind in {c.kind for c in base}:
            scaled = workload(name, scenario, rate_scale=rate / BASE_RATE_PER_S[kind], **kw)
            for i, c in enumerate(scaled):
                if c.kind == kind:
                    clients[i] = c
    if params:
        clients = [replace(c, params={**c.params, **params}) for c in clients]
    return clients


# ---------------------------------------------------------------------------------------------
# Rows


def harness_row(
    result: HarnessResult,
    clients: Sequence[ProgramClient],
    *,
    workload_name: str,
    scenario: str | None,
    dp: int,
    seed: int,
    server_info: Mapping[str, Any] | None = None,
    series: bool = True,
) -> dict[str, Any]:
    """The run as one row with the cluster experiments' fields (``cluster_runs.run_one``):
    the same metrics code over the client's observations, plus what only a live run has
    (failed and unsent calls, the harness's send lag)."""
    info = dict(server_info or {})
    records = result.records()
    events = result.events()
    t_end = result.t_end_s
    perceived = metrics.EventArrays.from_events(events, PERCEIVED)
    summary = metrics.summarize(perceived, records, window_s=max(result.duration_s / 10, 10.0))
    actual = metrics.EventArrays.from_events(events, ACTUAL)
    interval = metrics.active_interval(records)
    jain_actual = None
    if interval is not None and interval[1] > interval[0]:
        served = metrics.per_client_service(actual, t0=interval[0], t1=interval[1])
        jain_actual = metrics.jain_index(served.get(c.client, 0.0) for c in clients)
    well = {c.client for c in clients if c.well_behaved}
    started = result.started_programs
    done = [p for p in started if p.done and not p.failed]
    sent = result.sent
    lags = [c.send_s - c.arrival_s for c in sent if c.send_s is not None]
    row: dict[str, Any] = {
        **server_policy(info),
        "dp": dp,
        "workload": workload_name,
        "scenario": scenario,
        "x": None,
        **_wb_latency(
            result.latency_programs,
            records,
            well,
            t_end_s=t_end,
            use_ttft=workload_name == "longqa",
        ),
        **summary,
        "jain_actual": jain_actual,
        "misbehaving": sorted(c.client for c in clients if not c.well_behaved),
        "num_programs": len(result.programs),
        "num_programs_started": len(started),
        "num_programs_done": len(done),
        "num_programs_failed": sum(p.failed for p in started),
        "num_calls": len(records),
        "failed_calls": result.count("failed"),
        "unfinished_calls": result.count("unfinished"),
        "unsent_calls": result.count("unsent"),
        "makespan_s": t_end,
        "throughput_programs_s": len(done) / t_end if t_end > 0 else 0.0,
        "max_send_lag_s": max(lags, default=0.0),
        "max_loop_lag_s": result.max_loop_lag_s,
        "model": info.get("model") or info.get("model_path"),
        "gpu": info.get("gpu"),
        "backend": info.get("backend"),
        "kv_tokens": info.get("max_total_num_tokens"),
        "duration_s": result.duration_s,
        "drain_timeout_s": result.drain_timeout_s,
        "stopped": result.stopped,
        "seed": seed,
    }
    if series:
        row["series"] = service_series(events, records, t_end)
    return row


def fairness_table(
    result: HarnessResult,
    clients: Sequence[ProgramClient],
    *,
    use_ttft: bool = False,
) -> list[dict[str, Any]]:
    """Per client: role, programs and calls, tokens, the service received (client-perceived:
    input + 2 × output tokens, as the experiments' ``jain``) and its share of all service,
    and latency percentiles (program end-to-end; with ``use_ttft`` also the calls' TTFT)."""
    records = result.records()
    events = result.events()
    service = metrics.per_client_service(metrics.EventArrays.from_events(events, PERCEIVED))
    total = sum(service.values())
    programs: dict[str, list[Program]] = defaultdict(list)
    for p in result.started_programs:
        programs[p.client].append(p)
    calls: dict[str, list[CallRecord]] = defaultdict(list)
    for c in result.calls:
        calls[c.client].append(c)
    tokens: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for ev in events:
        t = tokens[ev.client]
        if ev.kind is EventKind.PREFILL:
            t[0] += ev.input_len
            t[2] += ev.input_len - ev.extend_len
        else:
            t[1] += ev.end - ev.start
    program_lat = client_latencies(
        result.latency_programs, records, t_end_s=result.t_end_s, use_ttft=False
    )
    ttft_lat = client_latencies(
        result.latency_programs, records, t_end_s=result.t_end_s, use_ttft=True
    )
    rows = []
    for spec in clients:
        c = spec.client
        progs, cs = programs.get(c, []), calls.get(c, [])
        lat = metrics.percentiles(program_lat.get(c, []))
        row = {
            "client": c,
            "kind": spec.kind,
            "role": "well-behaved" if spec.well_behaved else "misbehaving",
            "programs_started": len(progs),
            "programs_done": sum(p.done and not p.failed for p in progs),
            "programs_failed": sum(p.failed for p in progs),
            "calls_ok": sum(x.state == "ok" for x in cs),
            "calls_failed": sum(x.state == "failed" for x in cs),
            "calls_unfinished": sum(x.state in ("unfinished", "unsent") for x in cs),
            "input_tokens": tokens[c][0],
            "output_tokens": tokens[c][1],
            "cached_tokens": tokens[c][2],
            "service": service.get(c, 0.0),
            "share": service.get(c, 0.0) / total if total > 0 else 0.0,
            "program_p50_s": lat[50],
            "program_p99_s": lat[99],
        }
        if use_ttft:
            q = metrics.percentiles(ttft_lat.get(c, []))
            row["ttft_p50_s"], row["ttft_p99_s"] = q[50], q[99]
        rows.append(row)
    return rows
