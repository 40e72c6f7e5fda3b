"""The live router: the pure ``Router`` plus sockets, in-flight calls and worker liveness.

Runs on the HTTP server's asyncio loop (one process: HTTP front + router)::

    HTTP handler ──submit(req)──▶ Router.dispatch ──Dispatch──▶ worker i   (zmq PUSH)
         ▲                                                          │
         └─ Call.updated / Call.done ◀── Tokens, Finished, Load ◀───┘     (zmq PULL)
                                        KV events (SGLang format) ◀─────── (zmq SUB per worker)
                                                 └─▶ KVEventDecoder ─▶ Router.follow_kv

Worker failure: a worker whose process exits, whose socket is gone (a send finds no peer)
or that stays silent for ``heartbeat_timeout_s`` is removed from the router at once (never
selected again, its tree entries dropped). Each of its calls is re-dispatched to a live worker
if no token of it has reached the client yet (``Call.started``), else failed with a clear
error — none is silently lost, and a dispatch never fails because one worker is gone.

Silence is judged fairly: before a worker is declared silent, the frames already queued for
the router are read (a stalled router loop is not a dead worker), and a watchdog tick that
itself ran late judges nobody. A worker declared silent whose process still runs is taken
back as soon as it speaks again; the requests it still holds but that moved elsewhere are
aborted there. A worker process that exited is restarted by the launcher's ``restarter``
(when given) with exponential backoff; the new process says ``Hello`` and rejoins.
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
    KVSnapshot,
    Load,
    Shutdown,
    Tokens,
)
from sgl_fair.request import Request
from sgl_fair.router.kv_replay import replay
from sgl_fair.router.liveness import NoWorkerError, WorkerLiveness, WorkerState
from sgl_fair.router.notify import Notify
from sgl_fair.router.oit import refusal
from sgl_fair.router.protocol.scheduling import throttle_of
from sgl_fair.router.router import Router
from sgl_fair.router.telemetry import Telemetry
from sgl_fair.transport import Endpoints, WireError, decode, encode

log = logging.getLogger("sgl_fair.router")


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
    updated: Notify = field(default_factory=Notify)  # an asyncio.Event, cheaper per token
    done: Notify = field(default_factory=Notify)

    @property
    def rid(self) -> str:
        return self.req.rid


async def reap(tasks: list[asyncio.Task]) -> None:
    """Wait until ``tasks`` (already cancelled, or ending) are done, whatever they raise. A
    cancellation of the *caller* still ends the caller: ``asyncio.wait`` passes it on, where
    ``suppress(CancelledError)`` around ``await task`` swallowed it (a loop that was closing
    a link when it was cancelled then looped on forever)."""
    me = asyncio.current_task()
    pending = [t for t in tasks if t is not me and not t.done()]
    if pending:
        await asyncio.wait(pending)


class RouterService(WorkerLiveness):
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
        kv_replay_endpoints: list[str | None] | None = None,
        restarter: Callable[[int], Any] | None = None,
        restart_backoff_s: tuple[float, float] = (0.5, 30.0),
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``restarter(wid)`` starts worker ``wid``'s process again and returns it (the
        launcher's); without one a worker whose process exited stays out.
        ``restart_backoff_s``: the first delay and the cap; the delay doubles per restart and
        resets once a worker stays up for ``RESET_BACKOFF_AFTER_S``."""
        self.router = router
        self.endpoints = endpoints
        self.num_workers = num_workers
        self.telemetry = telemetry or Telemetry()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_attempts = max_attempts
        self.kv_endpoints = kv_endpoints or [endpoints.worker_kv(i) for i in range(num_workers)]
        self.kv_replay_endpoints = list(kv_replay_endpoints or ())
        self.clock = clock
        self.restarter = restarter
        self.restart_backoff_s = restart_backoff_s
        self.calls: dict[str, Call] = {}
        self.workers = {i: WorkerState(i) for i in range(num_workers)}
        for i, endpoint in enumerate(self.kv_replay_endpoints[:num_workers]):
            self.workers[i].kv_replay = endpoint
        self.ready = asyncio.Event()  # every worker said Hello
        self.hello_event = asyncio.Event()  # some worker said Hello (wait_ready's wake-up)
        self.closing = False
        self.num_redispatched = 0
        self.num_failed_by_death = 0
        self._flushes: dict[int, dict[int, bool]] = {}
        self._flush_token = 0
        self._flush_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # Workers inside this process (a bridge on the router's loop, ``attach_local``):
        # messages to them are handed over as objects, never encoded.
        self.local: dict[int, Callable[[Any], None]] = {}
        # Until a worker says Hello it takes no requests.
        for i in range(num_workers):
            router.remove_worker(i)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self.actx = zmq.asyncio.Context()
        self.sctx = zmq.Context()
        for ctx in (self.actx, self.sctx):  # frames for a peer that is gone never block exit
            ctx.setsockopt(zmq.LINGER, 0)
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

    async def wait_ready(self, timeout_s: float, min_ready: int | None = None) -> None:
        """Wait until ``min_ready`` workers (default: every one) said Hello; raise
        TimeoutError naming the missing ones, or RuntimeError at once when so many worker
        processes exited before they were up that ``min_ready`` cannot be reached. The
        others join when they say Hello, as at run time."""
        need = len(self.workers) if min_ready is None else min(min_ready, len(self.workers))
        deadline = self.clock() + timeout_s
        try:
            while sum(w.ever_ready for w in self.workers.values()) < need:
                failed = {w.wid: w.death for w in self.workers.values()
                          if w.death and not w.ever_ready}  # fmt: skip
                if failed and len(self.workers) - len(failed) < need:
                    raise RuntimeError(f"workers failed to start: {failed}")
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.hello_event.wait(), min(remaining, 0.25))
                self.hello_event.clear()
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
                if i in self.local:
                    self.local[i](Shutdown(i))
                    continue
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(encode(Shutdown(i)), zmq.NOBLOCK)
        for call in list(self.calls.values()):
            self._fail(call, "server is shutting down", 503)
        for t in self._tasks:
            t.cancel()
        await reap(self._tasks)
        await asyncio.sleep(0.05)  # let the Shutdown frames leave
        for sock in [self.pull, *self.push.values(), *self.subs.values()]:
            sock.close(linger=0)
        self.actx.term()
        self.sctx.term()

    def watch_process(self, worker: int, process: Any) -> None:
        self.workers[worker].process = process

    def attach_local(self, worker: int, handle: Callable[[Any], None]) -> None:
        """Worker ``worker`` runs inside this process: ``handle(msg)`` takes each message for
        it (on a later pass of the loop, never inside the caller); it answers through
        :meth:`deliver`."""
        self.local[worker] = handle

    def deliver(self, msg: Any) -> None:
        """A message from a worker inside this process, handled as a frame read off the
        socket is (an error is logged, never raised into the worker)."""
        try:
            self._on_message(msg)
        except Exception:
            log.exception("error handling %s", type(msg).__name__)

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, req: Request, tenant: str) -> Call:
        """Dispatch ``req``; raises NoWorkerError when no worker is alive. A request the
        router's cluster OIT refuses comes back done, with its ``Finished(REJECTED)``."""
        if req.rid in self.calls:
            raise ValueError(f"request id {req.rid!r} is already in flight")
        call = Call(req, tenant, self.clock())
        rejection = self.router.throttle(req, call.submit_s)  # the cluster OIT, if on
        if rejection is not None:  # answered as a worker's refusal would be: never sent
            call.finished = refusal(req, rejection, call.submit_s)
            call.done.set()
            call.updated.set()
            self._account(call, call.finished, call.submit_s)
            return call
        self._dispatch(call)
        self.calls[req.rid] = call
        return call

    def _dispatch(self, call: Call) -> None:
        """Send ``call`` to the worker the router picks; a worker whose socket has no peer
        (its process is gone, not yet noticed) is declared dead and the next one is tried."""
        while True:
            if not self.router.workers:
                raise NoWorkerError("no worker is alive", self.retry_after_s())
            call.attempts += 1
            msg = self.router.dispatch(call.req, self.clock())
            call.worker = msg.worker
            if self._send(msg.worker, msg):
                return
            call.worker = -1  # not the dead worker's any more: worker_dead leaves it to us
            self.worker_dead(msg.worker, "its socket has no peer (process gone)")

    def _send(self, wid: int, msg: Any) -> bool:
        """Queue ``msg`` for worker ``wid``; False when nobody is connected at the other end
        (with an unbounded queue, that is the only reason a non-blocking send fails)."""
        local = self.local.get(wid)
        if local is not None:
            proc = self.workers[wid].process
            if proc is not None and not proc.is_alive():
                return False
            local(msg)
            return True
        try:
            self.push[wid].send(encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def abort(self, call: Call, reason: str) -> None:
        """Ask the worker to drop ``call`` (its Finished(ABORTED) completes it)."""
        if call.done.is_set() or call.aborted is not None:
            return
        call.aborted = reason
        w = self.workers.get(call.worker)
        if w is None or not w.alive or not self._send(w.wid, Abort(w.wid, call.rid, reason)):
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
            if not self._send(w.wid, FlushCache(w.wid, token)):
                answers[w.wid] = False
        deadline = self.clock() + timeout_s
        while len(answers) < len(alive) and self.clock() < deadline:
            self._flush_event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_event.wait(), deadline - self.clock())
        self._flushes.pop(token, None)
        return {w.wid: answers.get(w.wid, False) for w in alive}

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
        if isinstance(msg, Finished) and msg.lost:
            self._lost(msg)
            return
        if type(msg) is Load and self._other_boot(w, msg):
            return
        if not w.alive:
            proc = w.process
            if w.restart_at is not None or (proc is not None and not proc.is_alive()):
                return  # a late frame from a process that is gone: its calls moved on
            self._revive(w)
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
            if msg.draining != w.stopping:
                self.worker_stopping(w, msg.draining)
        elif isinstance(msg, Flushed):
            answers = self._flushes.get(msg.token)
            if answers is not None:
                answers[msg.worker] = msg.ok
                self._flush_event.set()
        elif isinstance(msg, KVSnapshot):  # a remote worker's cache, as this replica attaches
            self._apply_kv(w, kv_events.decode_batch(msg.payload))

    def _lost(self, msg: Finished) -> None:
        """A call its worker lost with its engine (``Finished.lost``): the worker is dead to
        the router, whether or not its process or its silence said so yet, so this call and
        every other it holds go elsewhere where no token reached the client (``worker_dead``).
        Never a revival: a dead worker's late losses concern calls that moved on already."""
        w = self.workers[msg.worker]
        if w.alive:
            self.worker_dead(msg.worker, f"its engine stopped answering ({msg.error})")
        call = self.calls.get(msg.rid)
        if call is not None and call.worker == msg.worker:  # not one worker_dead moved on
            self._fail(call, f"worker {msg.worker} failed mid-request ({msg.error})", 502)

    def _account(self, call: Call, msg: Finished, now: float) -> None:
        req, tel = call.req, self.telemetry
        if msg.reason is FinishReason.REJECTED:
            why = "admission" if msg.retry_after_s is not None else "capacity"
            tel.rejected(call.tenant, why)
            throttle = throttle_of(msg.limit)
            if throttle is not None:
                where = "router" if msg.worker < 0 else "worker"
                tel.throttled(call.tenant, req.app, throttle.limit, where)
            if why == "admission":  # a policy's request limit: FairServe's OIT or rpm's
                tel.interactions.throttled(call.tenant, req.app, req.client, req.interaction_id)
            else:
                tel.interactions.seen(call.tenant, req.app, req.client)
            return
        # A call the router ended at its stop string completed, as one the worker ended does:
        # which of the two ends it first is a race, so both count "ok".
        outcome = "ok" if msg.ok or call.aborted == "stop" else "aborted"
        ttft_s = None if call.first_token_s is None else call.first_token_s - call.submit_s
        tel.finished(
            call.tenant,
            outcome=outcome,
            input_len=msg.input_len,
            cached=msg.prefix_len,
            output_len=msg.num_output,
            ttft_s=ttft_s,
            e2e_s=now - call.submit_s,
        )
        if outcome == "ok":
            tel.interactions.answered(
                call.tenant, req.app, req.client, req.interaction_id,
                tokens=msg.input_len + msg.num_output, output_len=msg.num_output,
                ttft_s=ttft_s, queue_s=msg.queue_s,
            )  # fmt: skip
        else:
            tel.interactions.seen(call.tenant, req.app, req.client)

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
            if seq != w.kv_seq + 1 and (w.kv_seq >= 0 or w.kv_replay is not None):
                await self._kv_gap(w, seq)  # a late router's first batch: its history, if kept
            w.kv_seq = seq
            self._apply_kv(w, batch)

    async def _kv_gap(self, w: WorkerState, seq: int) -> None:
        """Batches ``w.kv_seq + 1 .. seq - 1`` never came: replay them from the publisher's
        buffer where it has one (``router/kv_replay.py``), else count the gap."""
        start = w.kv_seq + 1
        got = None
        if w.kv_replay is not None:
            got = await replay(self.actx, w.kv_replay, start, seq)
        if got is not None and [s for s, _ in got] == list(range(start, seq)):
            for s, payload in got:
                w.kv_seq = s
                self._apply_kv(w, kv_events.decode_batch(payload))
            w.kv_replayed += len(got)
            return
        if w.kv_seq >= 0:  # a late router without the whole history starts from here
            w.kv_gaps += 1
            log.warning("worker %d: KV events %d..%d lost%s", w.wid, start, seq - 1,
                        "" if w.kv_replay is None else " (not in the replay buffer)")  # fmt: skip

    def _apply_kv(self, w: WorkerState, batch: kv_events.KVEventBatch) -> None:
        try:
            self.router.follow_kv(w.wid, w.decoder, batch, self.clock())
        except Exception:
            log.exception("worker %d: error applying KV events", w.wid)
