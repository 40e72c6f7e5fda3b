"""A live worker process: the worker scheduler on the simulated engine, in wall-clock time.

The loop is the simulator's, with real sleeping: start a step, wait its modelled duration
(divided by ``time_scale``; ``inf`` makes a zero-cost engine), meanwhile take in dispatches
and aborts, then publish its tokens and finishes. With ``backend="torch"`` the engine is a
real model (``worker/torch_engine``): its step has already taken its time when ``run``
returns (``synchronous``), so the loop completes it at once. Dispatches arriving during a
step join the queue when it ends, as in SGLang's continuous-batching loop::

    while running:
        poll zmq until the running step is due (or a message comes)
        handle Dispatch / Abort / FlushCache / Shutdown
        if the step is due: core.complete(...); publish Tokens/Finished/Load + KV events
        if idle: start the next step

The same ``WorkerCore`` runs inside the cluster simulator; nothing here knows about
fairness. KV-cache changes are published on a PUB socket in SGLang's KV-event format.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from sgl_fair import kv_events
from sgl_fair.messages import Abort, Dispatch, FlushCache, Flushed, Hello, Shutdown
from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.transport import Endpoints, WireError, decode, encode
from sgl_fair.worker.builder import build_worker, engine_kind
from sgl_fair.worker.scheduler import SchedulerConfig
from sgl_fair.worker.service import WorkerCore
from sgl_fair.worker.service_ledger import new_boot_id
from sgl_fair.worker.sim.text import EosLengths, TextModel

log = logging.getLogger("sgl_fair.worker")


@dataclass(frozen=True)
class LiveWorkerConfig:
    wid: int
    endpoints: str  # Endpoints.base
    policy: str = "dlpm"
    policy_opts: dict[str, Any] = field(default_factory=dict)
    gpu: str = "H100-80GB"
    model: str = "Llama-3.1-8B"
    tp: int | None = None
    kv_tokens: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    time_scale: float = 1.0  # simulated seconds per wall second; inf = zero-cost engine
    token_range: tuple[int, int] = (259, 32000)
    kv_page_size: int = 16
    load_interval_s: float = 0.1
    log_level: str = "warning"
    # What the simulated model says (sim.text): where it stops on its own (None: at
    # max_new_tokens), its EOS id, and the tokenizer's ids for ".", "," and "\n".
    eos_lengths: EosLengths | None = None
    eos_token_id: int | None = None
    text: TextModel | None = None
    # backend="torch": a real model (``model``: a preset such as "tiny" or a checkpoint
    # directory), its vocabulary sized to the tokenizer's (``vocab_size``, presets only).
    backend: str = "sim"
    vocab_size: int | None = None
    torch_dtype: str = "float32"
    torch_device: str = "cpu"
    torch_attention: str = "reference"
    torch_threads: int | None = None
    kv_allocator: str = "token"
    kv_allocator_opts: dict[str, Any] = field(default_factory=dict)


# The torch engine's pool when ``kv_tokens`` is not given: torch_engine.runner's
# LIVE_DEFAULT_KV_TOKENS, repeated here because importing that module imports torch.
TORCH_DEFAULT_KV_TOKENS = 16384


def build_core(cfg: LiveWorkerConfig) -> WorkerCore:
    """The worker on engine ``cfg.backend`` (``worker.builder``'s registry: ``sim`` or
    ``torch``, which imports torch only when asked for); its kind reads what it needs from
    ``cfg``."""
    return build_live(cfg)[0]


def build_live(cfg: LiveWorkerConfig) -> tuple[WorkerCore, int | None]:
    """``build_core``, and the longest sequence its engine serves (None: no bound)."""
    kind = engine_kind(cfg.backend)
    parts = kind.live_parts(cfg)
    sched, engine = build_worker(
        policy=make_policy(cfg.policy, **cfg.policy_opts),
        engine=cfg.backend,
        config=cfg.scheduler,
        allocator=cfg.kv_allocator,
        allocator_opts=cfg.kv_allocator_opts,
        **parts,
    )
    core = WorkerCore(
        cfg.wid,
        sched,
        engine,
        load_interval_s=cfg.load_interval_s,
        report_evictions=False,  # the router learns evictions from KV events
        kv_changes=True,
        keep_log=False,  # serving for days: hold only what is in flight
    )
    return core, kind.context_len(parts)


class LiveWorker:
    def __init__(self, cfg: LiveWorkerConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.core, self.context_len = build_live(cfg)
        self.boot = self.core.boot = new_boot_id()  # in its Hello and every Load
        self.encoder = kv_events.KVEventEncoder(page_size=cfg.kv_page_size)
        self.ctx = ctx or zmq.Context.instance()
        self.open_sockets()
        self.kv_seq = 0
        self.running = True
        self.drain_deadline: float | None = None  # set by begin_drain (a graceful stop)
        self._last_work_s = 0.0
        self._announce = False
        self.parent: int | None = os.getppid()  # None: not started by a launcher
        scale = cfg.time_scale
        if not scale > 0:
            raise ValueError(f"time_scale must be > 0 (got {scale})")
        self._wall_per_sim = 0.0 if math.isinf(scale) else 1.0 / scale
        # A real engine's step has taken its time when run() returns: do not wait it again.
        self.synchronous = engine_kind(cfg.backend).synchronous
        if self.synchronous:
            self._wall_per_sim = 0.0

    def open_sockets(self) -> None:
        """``inbox`` (commands), ``outbox`` (to the router) and ``kv_pub`` (KV events) on the
        launcher's endpoints; a standalone worker (``worker/remote.py``) opens its own."""
        ep = Endpoints(self.cfg.endpoints)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(ep.worker_in(self.cfg.wid))
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(ep.router_in)
        self.kv_pub = self.ctx.socket(zmq.PUB)
        self.kv_pub.setsockopt(zmq.LINGER, 0)
        self.kv_pub.bind(ep.worker_kv(self.cfg.wid))

    def hello(self) -> Hello:
        core = self.core
        return Hello(
            self.cfg.wid, time.time(), os.getpid(), core.scheduler.kv.capacity_tokens,
            self.engine_name(), context_len=self.context_len or 0, boot=self.boot,
        )  # fmt: skip

    # ---- io ---------------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        self.outbox.send(encode(msg), copy=False)

    def publish(self, now: float, changes: list) -> None:
        if not changes:
            return
        events = self.encoder.events(changes)
        if not events:
            return
        batch = kv_events.KVEventBatch(ts=now, events=events)
        frames = kv_events.multipart(b"", self.kv_seq, kv_events.encode_batch(batch))
        self.kv_seq += 1
        self.kv_pub.send_multipart(frames, copy=False)

    def flush_out(self, now: float, *, force_load: bool = False) -> None:
        drained = self.core.drain(now, force_load=force_load)
        self.publish(now, drained.kv_changes)
        for msg in drained.messages:
            self.send(msg)

    def natural_end(self, req: Request) -> Request:
        """Where the simulated model stops on its own: at its drawn EOS length if that comes
        before ``max_new_tokens``, unless the request asked to ``ignore_eos``. A real model
        stops where it samples EOS."""
        eos = self.cfg.eos_lengths
        if eos is None or self.synchronous or (req.sampling or {}).get("ignore_eos"):
            return req
        req.output_len = min(req.output_len, eos.length(req.rid))
        return req

    def handle(self, msg: Any) -> None:
        now = time.time()
        if isinstance(msg, Dispatch):
            self.core.add(self.natural_end(msg.req), now)
        elif isinstance(msg, Abort):
            self.core.abort(msg.rid, now, msg.reason)
        elif isinstance(msg, FlushCache):
            ok = self.core.flush()
            if ok:
                self.publish(now, self.core.scheduler.kv.drain_kv_events())
            self.send(Flushed(self.cfg.wid, msg.token, ok))
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.warning("worker %d: ignoring %s", self.cfg.wid, type(msg).__name__)

    def recv_all(self, timeout_s: float | None) -> None:
        """Wait up to ``timeout_s`` (None: forever) for a message, then take all queued ones."""
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                self.handle(decode(frame))
            except WireError as e:
                log.error("worker %d: dropped a bad frame: %s", self.cfg.wid, e)

    # ---- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        core = self.core
        self.send(self.hello())
        result = None
        due = 0.0
        heartbeat = self.cfg.load_interval_s
        while self.running:
            now = time.time()
            if result is None:
                wait = 0.0 if core.scheduler.has_work() else heartbeat
            else:  # wake at least every heartbeat, so a long step still reports Load
                wait = min(max(0.0, due - now), heartbeat)
            self.recv_all(wait)
            if not self.running:
                break
            now = time.time()
            if result is not None and now >= due:
                core.complete(result, now)
                result = None
            if result is None:
                result = core.step(now)
                if result is not None:
                    due = now + result.duration_s * self._wall_per_sim
            self.flush_out(now, force_load=self._announce)
            self._announce = False
            if self.drain_deadline is not None and self._drained(now, result):
                break
            if self.parent is not None and os.getppid() != self.parent:
                # the launcher is gone: do not linger
                log.error("worker %d: parent process exited; stopping", self.cfg.wid)
                break

    # ---- a graceful stop (SIGTERM) --------------------------------------------------------

    def begin_drain(self, timeout_s: float) -> None:
        """Stop after what this worker holds: every Load says ``draining`` (routers choose it
        for nothing new; a request dispatched before they heard is still served); the loop
        ends once nothing is left and nothing new came for two heartbeats, or after
        ``timeout_s`` whatever is left (its routers then see the worker gone)."""
        now = time.time()  # (a signal handler may call this: no socket is touched here)
        if self.drain_deadline is None:
            self.drain_deadline = now + timeout_s
            self.core.draining = True
            self._last_work_s = now
            self._announce = True  # the loop's next flush sends a Load that says so
            log.warning("worker %d: draining (up to %.0fs)", self.cfg.wid, timeout_s)

    def _drained(self, now: float, result: Any) -> bool:
        assert self.drain_deadline is not None
        if result is not None or self.core.scheduler.has_work():
            self._last_work_s = now
        elif now - self._last_work_s >= 2 * self.cfg.load_interval_s:
            log.warning("worker %d: drained; stopping", self.cfg.wid)
            return True
        if now >= self.drain_deadline:
            left = len(self.core.requests)
            log.error("worker %d: drain timed out with %d requests left; stopping",
                      self.cfg.wid, left)  # fmt: skip
            return True
        return False

    def engine_name(self) -> str:
        return engine_kind(self.cfg.backend).describe(self.cfg)

    def close(self) -> None:
        for sock in (self.inbox, self.outbox, self.kv_pub):
            sock.close()


def worker_main(cfg: LiveWorkerConfig) -> None:
    """Process entry point (multiprocessing spawn target)."""
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(asctime)s worker{cfg.wid} %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher shuts us down in order
    worker = LiveWorker(cfg)
    try:
        worker.run()
    finally:
        worker.close()
