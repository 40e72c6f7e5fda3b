"""A bridge worker: one SGLang server behind our router, speaking the router's worker protocol.

::

    router ──Dispatch / Abort / FlushCache / Shutdown──▶ bridge ──POST /generate (SSE)──▶ SGLang
    router ◀──Hello / Tokens / Finished / Load / Flushed── bridge ◀──── stream chunks ─────┘
    router ◀──────────── KV events: SGLang's own zmq publisher (--kv-events-config) ─────────┘

One per server: a process of its own, or a task inside the router's process and loop
(``bridge_link``: the same code, its messages handed across as objects). It waits for
``GET /health``, reads the server's capacity from ``/server_info``, says ``Hello``, then
turns each ``Dispatch`` into a streaming ``/generate`` with the request's token ids; the
client id travels as ``routing_key``, which our scheduler plugin reads inside SGLang (never
``extra_key``: that would partition SGLang's prefix cache).
Each stream chunk's new token ids go out in a ``Tokens`` message (those of every stream
read in one event-loop pass together: ``relay.TokenBatch``), its end as one ``Finished``.
Every failure is a ``Finished`` too (REJECTED for the server's 4xx, ABORTED otherwise): a
dispatched request is never lost.

Liveness: ``Load`` every ``load_interval_s`` is the router's heartbeat. The bridge exits
(non-zero, one log line) when ``/health`` has failed for ``health_timeout_s`` or the server
process it watches is gone, so the router's process watch marks the worker dead.

This module is the bridge (the requests in flight, liveness); how it reaches the router is
``bridge_link``; what SGLang's HTTP API
carries (probe, request body, stream events, error mapping) is in ``http_api``. No sglang
import: the bridge talks HTTP only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from sgl_fair.messages import (
    Abort,
    Dispatch,
    Finished,
    FinishReason,
    FlushCache,
    Flushed,
    Hello,
    Load,
    ServiceReport,
    Shutdown,
)
from sgl_fair.request import Request
from sgl_fair.worker.service_ledger import new_boot_id

from .bridge_link import ZmqLink
from .http_api import (
    Outcome,
    ServerInfo,
    StreamState,
    auth_headers,
    error_message,
    generate_body,
    get_json,
    plugin_check,
    probe_server,
    retry_after_header,
    service_report,
    status_outcome,
)
from .relay import TokenBatch, process_alive
from .sse_client import Pool

log = logging.getLogger("sgl_fair.bridge")
_json = msgspec.json.Encoder()

EXIT_SERVER_GONE = 3
EXIT_NOT_FAIR = 4  # the server does not run our plugin with the expected policy
# How often the Load loop asks whether the server's process or the launcher is gone (a
# /proc read per server): a bridge inside the router ran it 10 times a second per server.
GONE_CHECK_S = 0.5


@dataclass(frozen=True)
class BridgeConfig:
    wid: int
    endpoints: str  # Endpoints.base
    url: str  # the SGLang server, e.g. http://127.0.0.1:31000
    load_interval_s: float = 0.1
    load_poll_interval_s: float = 0.5  # SGLang's /v1/loads, where it has one
    health_interval_s: float = 5.0
    health_timeout_s: float = 30.0  # /health failing this long: exit
    startup_timeout_s: float = 600.0
    abort_grace_s: float = 1.0  # after /abort_request, wait this long before hanging up
    log_level: str = "warning"
    server_pid: int | None = None  # exit when this process is gone
    # Send each request's RT/BE class as SGLang's `priority` (settings.class_priority_values,
    # in the direction the server's /server_info reports): for a class-aware plugin policy
    # (BROS) on a server with --enable-priority-scheduling.
    class_priority: bool = False
    api_key: str | None = field(default=None, repr=False)  # the server's --api-key, if any
    # The local policy the server's plugin must run (its /server_info says), and its options:
    # a server without it is refused (EXIT_NOT_FAIR); other options are a warning.
    expect_policy: str | None = None
    expect_opts: dict[str, Any] = field(default_factory=dict)
    # This router is one of several replicas that share fairness (``router/replica.py``):
    # read the plugin's service ledger every ``service_poll_interval_s`` (``/server_info``)
    # and send it with the next ``Load``, as a standalone worker sends its own.
    share_service: bool = False
    service_poll_interval_s: float = 0.5


# ---- the process -----------------------------------------------------------------------------


def sglang_rid() -> str:
    """A fresh rid for one call to SGLang: 32 hex digits. SGLang aborts every request whose
    rid *starts with* the rid it is given (``Scheduler.abort_request``), so the client's rids
    (``job1`` is a prefix of ``job10`` and of its sample ``job1-1``) never reach it; rids of
    one fixed length are never a prefix of one another."""
    return uuid.uuid4().hex


@dataclass(eq=False)
class Job:
    req: Request
    stream: StreamState
    rid: str = field(default_factory=sglang_rid)  # the rid SGLang knows the request by
    tag: tuple[int, int] | None = None  # a router replica's (replica, charge): Dispatch.tag
    task: asyncio.Task | None = None
    abort_reason: str | None = None
    hang_up: asyncio.TimerHandle | None = field(default=None, repr=False)


class Bridge:
    def __init__(self, cfg: BridgeConfig, link: Any = None) -> None:
        """``link``: how it talks to the router (``bridge_link``): a ``ZmqLink`` of its own
        (a bridge process, the default) or a ``LocalLink`` (inside the router's process)."""
        self.cfg = cfg
        self.url = cfg.url.rstrip("/")
        self.link = link if link is not None else ZmqLink(cfg.wid, cfg.endpoints)
        self.info = ServerInfo()
        self.jobs: dict[str, Job] = {}
        self.loads: dict[str, Any] | None = None  # SGLang's latest /v1/loads entry
        self.service: ServiceReport | None = None  # the plugin's ledger, read, not yet sent
        self.done = asyncio.Event()
        self.exit_code = 0
        # a bridge process watches its launcher; one inside the router has none to watch
        self.parent = None if self.link.in_process else os.getppid()
        self.http: aiohttp.ClientSession | None = None  # every call but the streams
        self.generate: Pool | None = None  # the streams' connections
        self.tasks: list[asyncio.Task] = []  # the bridge's own loops (not the requests)
        self.side_tasks: set[asyncio.Task] = set()  # aborts and flushes in flight
        # The server stopped answering (a call's connection failed, then /health did): calls
        # are answered lost at once and no Load goes out until /health answers again, so the
        # router routes around this worker instead of taking it back at the next Load.
        self.server_down = False
        self.boot = new_boot_id()  # in its Hello and every Load
        # new tokens of every stream read in one event-loop pass: one Tokens message
        self.batch = TokenBatch(cfg.wid, self.link.send)
        self.tokens = self.batch.add

    # ---- io ------------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        self.batch.flush()  # the tokens read so far go first: a Finished never overtakes them
        self.link.send(msg)

    def stop(self, code: int, why: str | None = None) -> None:
        if self.done.is_set():
            return
        if why:
            log.error("bridge %d (%s): %s", self.cfg.wid, self.url, why)
        self.exit_code = code
        self.done.set()

    def _gone(self) -> str | None:
        """Why the bridge must stop: its server process or its launcher is gone."""
        pid = self.cfg.server_pid
        if pid is not None and not process_alive(pid):
            return f"SGLang server process {pid} is gone"
        if self.parent is not None and os.getppid() != self.parent:
            return "the launcher exited"
        return None

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self) -> int:
        connector = aiohttp.TCPConnector(limit=0)  # one connection per stream, no cap
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        headers = auth_headers(self.cfg.api_key)  # on every call: health, info, generate …
        self.generate = Pool(self.url, headers)  # the streams (sse_client.py)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as http:
            self.http = http
            if self.link.serve is not None:  # else the router hands messages to handle()
                self._spawn(self.link.serve(self.handle))
            self._spawn(self._start())
            try:
                await self.done.wait()
            finally:
                jobs = [j.task for j in self.jobs.values() if j.task is not None]
                pending = [*self.tasks, *self.side_tasks, *jobs]
                for t in pending:
                    t.cancel()  # hanging up makes SGLang abort the request
                await asyncio.gather(*pending, return_exceptions=True)
        return self.exit_code

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(self._task_ended)
        self.tasks.append(task)

    def _side(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.side_tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self.side_tasks.discard)

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.stop(1, f"internal error: {task.exception()!r}")

    async def _start(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not await self._healthy(min(cfg.health_timeout_s, 30.0)):
            gone = self._gone()
            if gone is not None:
                self.stop(EXIT_SERVER_GONE, f"{gone} before it was ready")
                return
            if time.monotonic() > deadline:
                self.stop(2, f"not ready within {cfg.startup_timeout_s:.0f}s")
                return
            await asyncio.sleep(0.5)
        self.info = await probe_server(self.http, self.url)
        if cfg.expect_policy is not None:
            refusal, warning = plugin_check(self.info, cfg.expect_policy, cfg.expect_opts)
            if refusal is not None:
                self.stop(EXIT_NOT_FAIR, f"SGLang server {self.url} {refusal}")
                return
            if warning is not None:
                log.warning("bridge %d: SGLang server %s: %s", cfg.wid, self.url, warning)
        kv_cap = self.info.kv_capacity_tokens
        hello = Hello(cfg.wid, time.time(), os.getpid(), kv_cap, self.info.engine,
                      context_len=self.info.context_len or 0, boot=self.boot)  # fmt: skip
        self.send(hello)
        log.info("bridge %d: %s ready (%s)", cfg.wid, self.url, self.info.engine)
        for coro in (self._load_loop(), self._health_loop(), self._poll_loads()):
            self._spawn(coro)
        if cfg.share_service:
            self._spawn(self._poll_service())

    async def _healthy(self, timeout_s: float) -> bool:
        try:
            async with self.http.get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    # ---- loops ---------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Dispatch):
            req = msg.req
            stream = StreamState(
                incremental=self.info.incremental, want_logprobs=req.return_logprob
            )
            job = Job(req, stream, tag=msg.tag)
            if self.server_down:  # answered at once: the router sends it elsewhere
                why = f"SGLang server {self.url} is not answering"
                self.send(self._finished(job, Outcome(FinishReason.ABORTED, why), lost=True))
                return
            self.jobs[req.rid] = job
            job.task = asyncio.get_running_loop().create_task(self._serve(job))
        elif isinstance(msg, Abort):
            job = self.jobs.get(msg.rid)
            if job is not None and job.abort_reason is None:
                job.abort_reason = msg.reason
                self._side(self._abort(job))
        elif isinstance(msg, FlushCache):
            self._side(self._flush(msg.token))
        elif isinstance(msg, Shutdown):
            self.stop(0)
        else:
            log.warning("bridge %d: ignoring %s", self.cfg.wid, type(msg).__name__)

    async def _load_loop(self) -> None:
        cfg = self.cfg
        check_at = 0.0  # whether the server or launcher is gone: every GONE_CHECK_S at most
        while True:
            now = time.monotonic()
            if now >= check_at:
                check_at = now + GONE_CHECK_S
                gone = self._gone()
                if gone is not None:
                    self.stop(EXIT_SERVER_GONE, gone)
                    return
            if not self.server_down:
                self.send(self._load())
            await asyncio.sleep(cfg.load_interval_s)

    def _load(self) -> Load:
        num_running = sum(1 for j in self.jobs.values() if j.stream.output_ids)
        num_waiting = len(self.jobs) - num_running
        kv_used = 0
        kv_cap = self.info.kv_capacity_tokens
        snap = self.loads
        if snap is not None:  # SGLang's own view, plus what is still on its way there
            num_running = int(snap.get("num_running_reqs", num_running))
            num_waiting = max(int(snap.get("num_waiting_reqs", 0)), len(self.jobs) - num_running)
            kv_used = int(snap.get("num_used_tokens", 0))
            kv_cap = int(snap.get("max_total_num_tokens") or kv_cap)
        service, self.service = self.service, None  # each report read goes out once
        return Load(self.cfg.wid, time.time(), num_waiting, num_running, kv_used, 0, kv_cap,
                    service=service, boot=self.boot)  # fmt: skip

    async def _poll_loads(self) -> None:
        """SGLang's ``GET /v1/loads``; stops at the first answer that is not one (a server
        without the endpoint: the in-flight counts stand alone)."""
        while True:
            got = await get_json(self.http, self.url + "/v1/loads?include=core", 5.0)
            loads = got.get("loads") if isinstance(got, dict) else None
            if not isinstance(loads, list) or not loads or not isinstance(loads[0], dict):
                self.loads = None
                return
            self.loads = loads[0]
            await asyncio.sleep(self.cfg.load_poll_interval_s)

    async def _poll_service(self) -> None:
        """The plugin's service ledger for the router replicas; said once if there is none."""
        said = None
        while True:
            got = await service_report(self.http, self.url)
            if isinstance(got, str):
                if got != said:
                    log.warning("bridge %d: %s shares no service with the other router "
                                "replicas: %s", self.cfg.wid, self.url, got)  # fmt: skip
                said = got
            else:
                self.service, said = got, None
            await asyncio.sleep(self.cfg.service_poll_interval_s)

    async def _health_loop(self) -> None:
        cfg = self.cfg
        last_ok = time.monotonic()
        while True:
            # while the server is down, every half second: back in service as soon as it is
            await asyncio.sleep(min(cfg.health_interval_s, 0.5) if self.server_down
                                else cfg.health_interval_s)  # fmt: skip
            if await self._healthy(cfg.health_timeout_s):
                last_ok = time.monotonic()
                if self.server_down:
                    log.warning("bridge %d: %s answers again", cfg.wid, self.url)
                    self.server_down = False
            elif time.monotonic() - last_ok > cfg.health_timeout_s:
                self.stop(
                    EXIT_SERVER_GONE, f"/health has failed for {time.monotonic() - last_ok:.1f}s"
                )
                return

    # ---- requests ------------------------------------------------------------------------

    async def _serve(self, job: Job) -> None:
        lost = False  # the call failed because the server went away, not for its own reason
        try:
            outcome = await self._stream(job)
        except asyncio.CancelledError:
            outcome = Outcome(FinishReason.ABORTED, job.abort_reason or "the bridge stopped")
            lost = job.abort_reason is None and self.exit_code == EXIT_SERVER_GONE
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            why = f"SGLang server {self.url}: {type(e).__name__}: {e}"
            outcome = Outcome(FinishReason.ABORTED, job.abort_reason or why)
            lost = job.abort_reason is None and await self._server_lost()
        except ValueError as e:  # a stream we cannot read: the call's, not the server's death
            why = f"SGLang server {self.url}: {type(e).__name__}: {e}"
            outcome = Outcome(FinishReason.ABORTED, job.abort_reason or why)
        except Exception as e:  # a bug must still answer the router
            log.exception("bridge %d: request %s failed", self.cfg.wid, job.req.rid)
            outcome = Outcome(FinishReason.ABORTED, f"bridge error: {type(e).__name__}: {e}")
        finally:
            if job.hang_up is not None:
                job.hang_up.cancel()
            self.jobs.pop(job.req.rid, None)
        self.send(self._finished(job, outcome, lost=lost))

    async def _server_lost(self) -> bool:
        """After a call's transport error: whether the server is gone (its /health does not
        answer within 2 s). Gone: the bridge is ``server_down`` until /health answers again."""
        if not self.server_down and not await self._healthy(2.0):
            log.warning("bridge %d: %s stopped answering", self.cfg.wid, self.url)
            self.server_down = True
        return self.server_down

    async def _stream(self, job: Job) -> Outcome:
        req = job.req
        body = generate_body(
            req,
            rid=job.rid,
            class_priority=self.cfg.class_priority,
            low_priority_first=self.info.low_priority_first,  # the server's own direction
            tag=job.tag,
            inflight=self.info.plugin is not None,
        )
        stream, rid, tokens = job.stream, req.rid, self.tokens

        def on_event(payload: bytes) -> None:  # in the loop's read callback: no task woken
            new = stream.feed_bytes(payload)
            if new:
                tokens(rid, tuple(new))

        call = await self.generate.post(_json.encode(body), on_event)
        result = call.result
        try:
            status = await result
        finally:
            call.hang_up(result)  # unless it ended well: the connection goes (SGLang aborts)
        if status != 200:
            text = call.body.decode(errors="replace")
            retry = retry_after_header(call.headers.get("retry-after"))
            return status_outcome(status, error_message(text, status), retry)
        return stream.outcome(job.abort_reason)

    def _finished(self, job: Job, outcome: Outcome, *, lost: bool = False) -> Finished:
        req, stream = job.req, job.stream
        rejected = outcome.reason is FinishReason.REJECTED
        return Finished(
            worker=self.cfg.wid,
            t_s=time.time(),
            rid=req.rid,
            client=req.client,
            reason=outcome.reason,
            input_ids=req.input_ids,
            output_ids=() if rejected else tuple(stream.output_ids),
            prefix_len=0 if rejected else stream.cached_tokens,
            error=outcome.error,
            retry_after_s=outcome.retry_after_s,
            queue_s=None if rejected else stream.queue_s,
            lost=lost,
            **({} if rejected else stream.finished_logprobs()),
        )

    async def _abort(self, job: Job) -> None:
        """SGLang's /abort_request ends the stream with an abort; if it does not (the server
        had not registered the rid yet), hang up after ``abort_grace_s``: SGLang aborts a
        request whose client went away."""
        if job.task is None or job.task.done():
            return
        job.hang_up = asyncio.get_running_loop().call_later(self.cfg.abort_grace_s, job.task.cancel)
        try:
            async with self.http.post(
                self.url + "/abort_request",
                json={"rid": job.rid},  # ours alone: SGLang aborts by prefix
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                if resp.status != 200:
                    log.warning("bridge %d: /abort_request answered %d", self.cfg.wid, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("bridge %d: /abort_request failed: %s", self.cfg.wid, e)
            job.task.cancel()

    async def _flush(self, token: int) -> None:
        ok = False
        try:
            async with self.http.post(
                self.url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("bridge %d: /flush_cache failed: %s", self.cfg.wid, e)
        self.send(Flushed(self.cfg.wid, token, ok))

    def close(self) -> None:
        if self.generate is not None:
            self.generate.close()
        self.link.close()


__all__ = ["Bridge", "BridgeConfig"]
