"""The live router: the pure ``Router`` plus sockets, in-flight calls and worker liveness.

Runs on the HTTP server's asyncio loop (one process: HTTP front + router)::

    HTTP handler ──submit(req)──▶ Router.dispatch ──Dispatch──▶ worker i   (zmq PUSH)
         ▲                                                          │
         └─ Call.updated / Call.done ◀── Tokens, Finished, Load ◀───┘     (zmq PULL)
                                        KV events (SGLang format) ◀─────── (zmq SUB per worker)
                                                 └─▶ KVEventDecoder ─▶ Router.apply_kv_ops

Worker failure: a worker whose process exits or that stays silent for
``heartbeat_timeout_s`` is removed from the router at once (never selected again, its tree
entries dropped). Each of its calls is re-dispatched to a live worker if no token of it
has reached the client yet (``Call.started``), else failed with a clear error — none is
silently lost. A worker that says ``Hello`` again (restarted) rejoins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from sgl_fair import kv_events
from sgl_fair.messages import (
    Abort,
    Finished,
    FinishReason,
    FlushCache,
    Flushed,
    Hello,
    Load,
    Shutdown,
    Tokens,
)
from sgl_fair.request import Request
from sgl_fair.router.router import Router
from sgl_fair.router.telemetry import Telemetry
from sgl_fair.transport import Endpoints, WireError, decode, encode

log = logging.getLogger("sgl_fair.router")


class NoWorkerError(RuntimeError):
    """No live worker can take a request (HTTP 503)."""


@dataclass(eq=False)
class Call:
    """One request in flight through the router, as the HTTP handler sees it."""

    req: Request
    tenant: str
    submit_s: float
    tokens: list[int] = field(default_factory=list)  # output ids received so far
    worker: int = -1
    attempts: int = 0
    started: bool = False  # set by the handler once tokens reached the client
    first_token_s: float | None = None
    finished: Finished | None = None
    error: str | None = None  # set when the call failed without a worker's answer
    error_status: int = 500
    aborted: str | None = None  # why we asked the worker to abort it
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclass
class WorkerState:
    wid: int
    alive: bool = False  # said Hello and has not died since
    ever_ready: bool = False
    pid: int | None = None
    engine: str = ""
    kv_capacity_tokens: int = 0
    last_seen: float = 0.0
    death: str | None = None
    process: Any = None  # multiprocessing.Process when the launcher started it
    kv_seq: int = -1
    kv_gaps: int = 0
    decoder: kv_events.KVEventDecoder = field(default_factory=kv_events.KVEventDecoder)


class RouterService:
    def __init__(
        self,
        router: Router,
        endpoints: Endpoints,
        num_workers: int,
        *,
        telemetry: Telemetry | None = None,
        heartbeat_timeout_s: float = 10.0,
        max_attempts: int = 3,
        kv_endpoints: list[str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.router = router
        self.endpoints = endpoints
        self.num_workers = num_workers
        self.telemetry = telemetry or Telemetry()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_attempts = max_attempts
        self.kv_endpoints = kv_endpoints or [endpoints.worker_kv(i) for i in range(num_workers)]
        self.clock = clock
        self.calls: dict[str, Call] = {}
        self.workers = {i: WorkerState(i) for i in range(num_workers)}
        self.ready = asyncio.Event()
        self.closing = False
        self.num_redispatched = 0
        self.num_failed_by_death = 0
        self._flushes: dict[int, dict[int, bool]] = {}
        self._flush_token = 0
        self._flush_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # Until a worker says Hello it takes no requests.
        for i in range(num_workers):
            router.remove_worker(i)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self.actx = zmq.asyncio.Context()
        self.sctx = zmq.Context()
        ep = self.endpoints
        self.pull = self.actx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(ep.router_in)
        self.push: dict[int, zmq.Socket] = {}
        for i in range(self.num_workers):
            s = self.sctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(ep.worker_in(i))
            self.push[i] = s
        self.subs: dict[int, zmq.asyncio.Socket] = {}
        for i, endpoint in enumerate(self.kv_endpoints):
            s = self.actx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(endpoint)
            self.subs[i] = s
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv_loop(), name="router-recv")]
        self._tasks += [
            loop.create_task(self._kv_loop(i, s), name=f"router-kv-{i}")
            for i, s in self.subs.items()
        ]
        self._tasks.append(loop.create_task(self._watch_loop(), name="router-watch"))

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every worker said Hello; raise TimeoutError naming the missing ones, or
        RuntimeError at once when a worker process exits before it is up."""
        deadline = self.clock() + timeout_s
        try:
            while not self.ready.is_set():
                failed = {w.wid: w.death for w in self.workers.values() if w.death}
                if failed:
                    raise RuntimeError(f"workers failed to start: {failed}")
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.ready.wait(), min(remaining, 0.25))
        except asyncio.TimeoutError:
            missing = [w.wid for w in self.workers.values() if not w.ever_ready]
            dead = {w.wid: w.death for w in self.workers.values() if w.death}
            raise TimeoutError(
                f"workers {missing} did not start within {timeout_s:.0f}s"
                + (f" (died: {dead})" if dead else "")
            ) from None

    async def close(self, *, shutdown_workers: bool = True) -> None:
        self.closing = True
        if shutdown_workers:
            for i, sock in self.push.items():
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(encode(Shutdown(i)), zmq.NOBLOCK)
        for call in list(self.calls.values()):
            self._fail(call, "server is shutting down", 503)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.sleep(0.05)  # let the Shutdown frames leave
        for sock in [self.pull, *self.push.values(), *self.subs.values()]:
            sock.close(linger=0)
        self.actx.term()
        self.sctx.term()

    def watch_process(self, worker: int, process: Any) -> None:
        self.workers[worker].process = process

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, req: Request, tenant: str) -> Call:
        """Dispatch ``req``; raises NoWorkerError when no worker is alive."""
        if req.rid in self.calls:
            raise ValueError(f"request id {req.rid!r} is already in flight")
        call = Call(req, tenant, self.clock())
        self._dispatch(call)
        self.calls[req.rid] = call
        return call

    def _dispatch(self, call: Call) -> None:
        if not self.router.workers:
            raise NoWorkerError("no worker is alive")
        call.attempts += 1
        msg = self.router.dispatch(call.req, self.clock())
        call.worker = msg.worker
        self.push[msg.worker].send(encode(msg), zmq.NOBLOCK, copy=False)

    def abort(self, call: Call, reason: str) -> None:
        """Ask the worker to drop ``call`` (its Finished(ABORTED) completes it)."""
        if call.done.is_set() or call.aborted is not None:
            return
        call.aborted = reason
        if self.workers[call.worker].alive:
            self.push[call.worker].send(encode(Abort(call.worker, call.rid, reason)), zmq.NOBLOCK)
        else:
            self._fail(call, reason, 499)

    def _fail(self, call: Call, error: str, status: int) -> None:
        if call.done.is_set():
            return
        call.error = error
        call.error_status = status
        self.calls.pop(call.rid, None)
        call.done.set()
        call.updated.set()

    async def flush_cache(self, timeout_s: float = 5.0) -> dict[int, bool]:
        """SGLang's /flush_cache on every live worker; a worker refuses while it has requests."""
        self._flush_token += 1
        token = self._flush_token
        alive = [w for w in self.workers.values() if w.alive]
        answers: dict[int, bool] = {}
        self._flushes[token] = answers
        for w in alive:
            self.push[w.wid].send(encode(FlushCache(w.wid, token)), zmq.NOBLOCK)
        deadline = self.clock() + timeout_s
        while len(answers) < len(alive) and self.clock() < deadline:
            self._flush_event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_event.wait(), deadline - self.clock())
        self._flushes.pop(token, None)
        return {w.wid: answers.get(w.wid, False) for w in alive}

    # ---- workers ----------------------------------------------------------------------------

    def worker_dead(self, wid: int, why: str) -> None:
        w = self.workers[wid]
        if not w.alive and w.death is not None:
            return
        w.alive = False
        w.death = why
        self.telemetry.worker_alive(wid, False)
        if self.closing:
            return
        log.error("worker %d is gone (%s); routing around it", wid, why)
        lost = self.router.remove_worker(wid)
        w.decoder = kv_events.KVEventDecoder()
        w.kv_seq = -1
        for rid in lost:
            call = self.calls.get(rid)
            if call is None:
                continue
            if call.started or call.aborted is not None or call.attempts >= self.max_attempts:
                self.num_failed_by_death += 1
                self._fail(call, f"worker {wid} failed mid-request ({why})", 502)
                continue
            call.tokens.clear()
            call.first_token_s = None
            call.req = call.req.unscheduled_copy()
            try:
                self._dispatch(call)
                self.num_redispatched += 1
            except NoWorkerError:
                self.num_failed_by_death += 1
                self._fail(call, f"worker {wid} failed and no other worker is alive", 503)

    def _hello(self, msg: Hello) -> None:
        w = self.workers.get(msg.worker)
        if w is None:
            log.error("Hello from unknown worker %d ignored", msg.worker)
            return
        w.alive = True
        w.death = None
        w.ever_ready = True
        w.pid = msg.pid
        w.engine = msg.engine
        w.kv_capacity_tokens = msg.kv_capacity_tokens
        w.last_seen = self.clock()
        self.router.add_worker(msg.worker)
        self.telemetry.worker_alive(msg.worker, True)
        log.info("worker %d ready (pid %d, %s)", msg.worker, msg.pid, msg.engine)
        if all(x.ever_ready for x in self.workers.values()):
            self.ready.set()

    # ---- loops ------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        pull = self.pull
        while True:
            frame = await pull.recv(copy=True)
            self._on_frame(frame)
            while True:  # take whatever else is queued without a round trip through the loop
                try:
                    frame = zmq.Socket.recv(pull, zmq.NOBLOCK)  # the synchronous recv
                except zmq.Again:
                    break
                self._on_frame(frame)

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = decode(frame)
        except WireError as e:
            log.error("dropped a bad frame from a worker: %s", e)
            return
        try:
            self._on_message(msg)
        except Exception:  # a bug must not kill the receive loop (every request would hang)
            log.exception("error handling %s", type(msg).__name__)

    def _on_message(self, msg: Any) -> None:
        now = self.clock()
        w = self.workers.get(getattr(msg, "worker", -1))
        if w is None:
            return
        if isinstance(msg, Hello):
            self._hello(msg)
            return
        if not w.alive:
            return  # late message from a worker declared dead: its calls moved on
        w.last_seen = now
        if isinstance(msg, Tokens):
            self.router.handle(msg, now)
            calls = self.calls
            for rid, ids in msg.items:
                call = calls.get(rid)
                if call is not None and call.worker == msg.worker:
                    if call.first_token_s is None:
                        call.first_token_s = now
                    call.tokens.extend(ids)
                    call.updated.set()
        elif isinstance(msg, Finished):
            self.router.handle(msg, now)
            call = self.calls.get(msg.rid)
            if call is not None and call.worker == msg.worker:
                del self.calls[msg.rid]
                if call.first_token_s is None and msg.output_ids:
                    call.first_token_s = now
                call.tokens[:] = msg.output_ids
                call.finished = msg
                call.done.set()
                call.updated.set()
                self._account(call, msg, now)
        elif isinstance(msg, Load):
            self.router.handle(msg, now)
            self.telemetry.load(msg, self.router.queue_len(msg.worker))
        elif isinstance(msg, Flushed):
            answers = self._flushes.get(msg.token)
            if answers is not None:
                answers[msg.worker] = msg.ok
                self._flush_event.set()

    def _account(self, call: Call, msg: Finished, now: float) -> None:
        if msg.reason is FinishReason.REJECTED:
            why = "admission" if msg.retry_after_s is not None else "capacity"
            self.telemetry.rejected(call.tenant, why)
            return
        outcome = "ok" if msg.ok else ("stopped" if call.aborted == "stop" else "aborted")
        self.telemetry.finished(
            call.tenant,
            outcome=outcome,
            input_len=msg.input_len,
            cached=msg.prefix_len,
            output_len=msg.num_output,
            ttft_s=None if call.first_token_s is None else call.first_token_s - call.submit_s,
            e2e_s=now - call.submit_s,
        )

    async def _kv_loop(self, wid: int, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=True)
            w = self.workers[wid]
            if not w.alive:
                continue
            try:
                _topic, seq, payload = kv_events.parse_multipart(frames)
                batch = kv_events.decode_batch(payload)
            except ValueError as e:
                log.error("worker %d: bad KV event frame: %s", wid, e)
                continue
            if w.kv_seq >= 0 and seq != w.kv_seq + 1:
                w.kv_gaps += 1
                log.warning("worker %d: KV events %d..%d lost", wid, w.kv_seq + 1, seq - 1)
            w.kv_seq = seq
            try:
                ops = w.decoder.apply(batch)
                self.router.apply_kv_ops(wid, ops, self.clock())
            except Exception:
                log.exception("worker %d: error applying KV events", wid)

    async def _watch_loop(self, period_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(period_s)
            now = self.clock()
            for w in self.workers.values():
                if w.death is not None and not w.alive:
                    continue
                proc = w.process
                if proc is not None and not proc.is_alive():
                    self.worker_dead(w.wid, f"process exited with code {proc.exitcode}")
                elif w.alive and now - w.last_seen > self.heartbeat_timeout_s:
                    self.worker_dead(w.wid, f"no message for {now - w.last_seen:.1f}s")
