"""Worker liveness for the live router: who is up, who died, who is restarted or taken back.

``WorkerLiveness`` is a mixin of ``RouterService`` (``router/service.py``) and uses its state:
``router``, ``workers``, ``calls``, ``telemetry``, ``clock``, ``closing``, ``restarter``,
``restart_backoff_s``, ``heartbeat_timeout_s``, ``max_attempts``, ``pull``, ``ready``, the
counters ``num_redispatched`` and ``num_failed_by_death``, and its ``_dispatch``, ``_send``,
``_fail`` and ``_on_frame``. The rules (which worker counts as
dead, what happens to its calls, how restarts back off) are in the service's docstring.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import zmq

from sgl_fair import kv_decoder
from sgl_fair.messages import PROTOCOL_VERSION, Abort, Hello, Load

log = logging.getLogger("sgl_fair.router")


class NoWorkerError(RuntimeError):
    """No live worker can take a request (HTTP 503 with ``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class WorkerState:
    wid: int
    alive: bool = False  # said Hello and has not died since
    ever_ready: bool = False
    pid: int | None = None
    engine: str = ""
    kv_capacity_tokens: int = 0
    context_len: int = 0  # from its Hello; 0: not known
    last_seen: float = 0.0
    death: str | None = None
    process: Any = None  # multiprocessing.Process when the launcher started it
    kv_seq: int = -1
    kv_gaps: int = 0  # KV-event batches lost (not replayed)
    kv_replay: str | None = None  # its publisher's replay endpoint, if it keeps one
    kv_replayed: int = 0  # KV-event batches missed, then replayed from the publisher
    decoder: kv_decoder.KVEventDecoder = field(default_factory=kv_decoder.KVEventDecoder)
    num_restarts: int = 0  # processes the launcher started again after this one exited
    restart_at: float | None = None  # when the next restart is due (backoff)
    backoff_s: float = 0.0
    ready_s: float = 0.0  # when it last said Hello (a long life resets the backoff)
    num_revived: int = 0  # declared silent, then heard from again
    orphans: set[str] = field(default_factory=set)  # rids it holds that moved elsewhere
    boot: int = 0  # its process's boot id, from its Hello (0: not said)
    stopping: bool = False  # its Load said it drains (a SIGTERM): the router drains it


class WorkerLiveness:
    RESET_BACKOFF_AFTER_S = 60.0

    def worker_stopping(self, w: WorkerState, stopping: bool) -> None:
        """A worker says it drains (its SIGTERM): choose it for nothing new while what it
        holds finishes; it exits then, and is dead as any other. Said no more (a new process
        of it): choosable again (an operator's drain, ``DELETE /workers``, is kept: its
        loop drains the worker again every period)."""
        w.stopping = stopping
        router = self.router
        if w.wid not in router.workers and w.wid not in router.draining:
            return  # not alive in the router (a late frame)
        if stopping:
            log.warning("worker %d is stopping: choosing it for no new request", w.wid)
        router.drain_worker(w.wid, draining=stopping)

    def restart_in_s(self, wid: int) -> float | None:
        """Seconds until worker ``wid``'s process is started again; None if none is due."""
        due = self.workers[wid].restart_at
        return None if due is None else round(max(0.0, due - self.clock()), 3)

    def retry_after_s(self) -> float:
        """When a client should try again with no worker alive: the next restart due."""
        due = [w.restart_at for w in self.workers.values() if w.restart_at is not None]
        if not due:
            return 5.0
        return max(1.0, min(due) - self.clock() + 1.0)

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
        w.decoder = kv_decoder.KVEventDecoder()
        w.kv_seq = -1
        if w.process is not None and self.restarter is not None and not w.process.is_alive():
            self._schedule_restart(w)
        for rid in lost:
            call = self.calls.get(rid)
            if call is None or call.worker != wid:
                continue
            w.orphans.add(rid)  # if it comes back, it still holds this one
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

    def _schedule_restart(self, w: WorkerState) -> None:
        lo, hi = self.restart_backoff_s
        if w.ready_s and self.clock() - w.ready_s >= self.RESET_BACKOFF_AFTER_S:
            w.backoff_s = 0.0  # it had been up a long time: start over
        w.backoff_s = lo if w.backoff_s <= 0 else min(hi, 2 * w.backoff_s)
        w.restart_at = self.clock() + w.backoff_s
        log.warning("restarting worker %d in %.1fs", w.wid, w.backoff_s)

    def _restart(self, w: WorkerState) -> None:
        w.restart_at = None
        assert self.restarter is not None
        try:
            w.process = self.restarter(w.wid)
        except Exception as e:  # a failed start is retried later, never fatal to the router
            log.error("could not restart worker %d: %s", w.wid, e)
            self._schedule_restart(w)
            return
        w.num_restarts += 1
        w.orphans.clear()  # a new process holds nothing
        self.telemetry.worker_restarted(w.wid)

    def _revive(self, w: WorkerState) -> None:
        """A worker declared silent spoke again: its process never stopped. Take it back;
        the requests that moved elsewhere meanwhile are aborted there."""
        log.warning("worker %d is answering again (was: %s); taking it back", w.wid, w.death)
        w.alive = True
        w.death = None
        w.num_revived += 1
        w.last_seen = self.clock()
        self.router.add_worker(w.wid)
        self.telemetry.worker_alive(w.wid, True)
        for rid in w.orphans:
            self._send(w.wid, Abort(w.wid, rid, "reassigned while this worker was silent"))
        w.orphans.clear()

    def _hello(self, msg: Hello) -> None:
        w = self.workers.get(msg.worker)
        if w is None:
            log.error("Hello from unknown worker %d ignored", msg.worker)
            return
        if msg.version != PROTOCOL_VERSION:
            log.error("worker %d speaks protocol %d, this router %d: not taken", msg.worker,
                      msg.version, PROTOCOL_VERSION)  # fmt: skip
            return
        if w.alive and w.ever_ready:  # a Hello on a live link: what it held of ours is gone
            if msg.boot != w.boot or msg.pid != w.pid:
                why = f"restarted (pid {w.pid} -> {msg.pid}, boot {w.boot:x} -> {msg.boot:x})"
            else:
                why = "it lost this router's state (it forgot this router; same process)"
            self.worker_dead(msg.worker, why)
        w.boot = msg.boot
        w.alive = True
        w.death = None
        w.ever_ready = True
        w.ready_s = self.clock()
        w.restart_at = None
        w.pid = msg.pid
        w.engine = msg.engine
        w.kv_capacity_tokens = msg.kv_capacity_tokens
        w.context_len = msg.context_len
        w.last_seen = self.clock()
        self.router.add_worker(msg.worker)
        self.telemetry.worker_alive(msg.worker, True)
        log.info("worker %d ready (pid %d, %s)", msg.worker, msg.pid, msg.engine)
        # Calls moved elsewhere while it was gone: the dispatch that made a restarted worker
        # say Hello may run there too; an abort of one it does not hold does nothing.
        for rid in w.orphans:
            self._send(w.wid, Abort(w.wid, rid, "moved to another worker"))
        w.orphans.clear()
        self.hello_event.set()
        if all(x.ever_ready for x in self.workers.values()):
            self.ready.set()

    def _other_boot(self, w: WorkerState, msg: Load) -> bool:
        """A Load from another process than the one that said Hello (it restarted, and has
        not said Hello to this router yet): a death if it was alive; never a revival."""
        if not msg.boot or not w.boot or msg.boot == w.boot:
            return False
        if w.alive:
            self.worker_dead(w.wid, f"restarted (boot {w.boot:x} -> {msg.boot:x})")
        return True

    def _drain_pull(self) -> None:
        """Handle every frame already queued for the router (synchronously)."""
        while True:
            try:
                frame = zmq.Socket.recv(self.pull, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frame(frame)

    async def _watch_loop(self, period_s: float = 0.2) -> None:
        last_tick = self.clock()
        while True:
            await asyncio.sleep(period_s)
            now = self.clock()
            self.watch_tick(now, late_s=now - last_tick - period_s)
            last_tick = now

    def watch_tick(self, now: float, *, late_s: float = 0.0) -> None:
        """One watchdog round: due restarts, exited processes, silent workers. ``late_s``:
        how late this round runs (the loop's own stall)."""
        self.telemetry.loop_lag(late_s)
        for w in self.workers.values():
            if w.restart_at is not None and now >= w.restart_at and not self.closing:
                self._restart(w)
            if w.death is not None and not w.alive:
                continue
            proc = w.process
            if proc is not None and not proc.is_alive():
                self.worker_dead(w.wid, f"process exited with code {proc.exitcode}")
        if late_s > self.heartbeat_timeout_s / 4:
            # This round itself ran late: the router was stalled, so the workers' silence
            # says nothing about them. Judge again next round, once their frames are read.
            log.warning("router loop stalled for %.1fs; liveness not judged", late_s)
            return
        silent = [
            w for w in self.workers.values()
            if w.alive and now - w.last_seen > self.heartbeat_timeout_s
        ]  # fmt: skip
        if not silent:
            return
        self._drain_pull()  # their heartbeats may be queued behind our own stall
        for w in silent:
            if w.alive and now - w.last_seen > self.heartbeat_timeout_s:
                self.worker_dead(w.wid, f"no message for {now - w.last_seen:.1f}s")
