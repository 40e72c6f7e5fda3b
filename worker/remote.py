"""A standalone worker that serves router replicas over tcp (``python -m sgl_fair.worker``).

The live worker's loop (``worker/live.py``) on the remote endpoint's sockets
(``sgl_fair/remote.py`` draws them): a ROUTER socket every replica's DEALER connects to, and
the KV-event PUB beside it. What it adds to the loop is who gets what: a request's Tokens and
Finished go to the replica that dispatched it, Load to every replica attached, and a replica
that leaves (``Detach``, its ``Shutdown``, a closed connection, or silence past
``peer_timeout_s``) has its requests aborted. A request id already running here for another
replica is refused (``Finished(REJECTED)``), never mixed up.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from sgl_fair import kv_events
from sgl_fair.messages import (
    PROTOCOL_VERSION,
    Abort,
    Dispatch,
    Finished,
    FinishReason,
    KVSnapshot,
    Load,
    Shutdown,
    Tokens,
)
from sgl_fair.remote import (
    ATTACH_PERIOD_S,
    Attach,
    Detach,
    ServerKeys,
    curve_server,
    decode_frame,
    kv_address,
)
from sgl_fair.transport import WireError, encode
from sgl_fair.worker.live import LiveWorker, LiveWorkerConfig
from sgl_fair.worker.service_ledger import ServiceLedger

log = logging.getLogger("sgl_fair.worker")


class RemoteWorker(LiveWorker):
    def __init__(
        self,
        cfg: LiveWorkerConfig,
        bind: str,
        *,
        keys: ServerKeys | None = None,
        peer_timeout_s: float = 15 * ATTACH_PERIOD_S,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.bind = bind
        self.keys = keys
        self.peer_timeout_s = peer_timeout_s
        self.auth: Any = None
        self.peers: dict[bytes, float] = {}  # replica identity -> when last heard
        self.names: dict[bytes, str] = {}
        self.owners: dict[str, bytes] = {}  # rid -> the replica that dispatched it
        self._peer: bytes | None = None  # whose frame is being handled
        self._ever_tagged = False
        self._housekeeping_s = 0.0
        super().__init__(cfg, ctx=ctx)
        self.ledger = ServiceLedger(boot=self.boot)  # what tagged dispatches got: in each Load
        self.parent = None  # standalone: no launcher to outlive

    def open_sockets(self) -> None:
        if self.keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=self.keys.authorized_dir)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone replica raises
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.kv_pub = self.ctx.socket(zmq.PUB)
        self.kv_pub.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            curve_server(self.sock, self.keys)
            curve_server(self.kv_pub, self.keys)
        self.sock.bind(self.bind)
        self.kv_pub.bind(kv_address(self.bind))
        self.inbox = self.outbox = self.sock

    # ---- who gets what ----------------------------------------------------------------------

    def _to(self, peer: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # EHOSTUNREACH: its connection is gone
            self.forget(peer, f"send failed ({e.strerror})")

    def send(self, msg: Any) -> None:
        if type(msg) is Tokens:
            by_peer: dict[bytes, list] = defaultdict(list)
            for item in msg.items:
                peer = self.owners.get(item[0])
                if peer is not None:
                    by_peer[peer].append(item)
            for peer, items in by_peer.items():
                self._to(peer, Tokens(msg.worker, msg.t_s, tuple(items)))
        elif type(msg) is Finished:
            peer = self.owners.pop(msg.rid, None)
            self.ledger.sent(msg.rid, msg.num_output)  # counted as it goes out
            if peer is not None:
                self._to(peer, msg)
        elif type(msg) is Load:
            if self._ever_tagged:
                msg = msgspec.structs.replace(msg, service=self.ledger.report())
            for peer in list(self.peers):
                self._to(peer, msg)
        elif self._peer is not None:  # Flushed, Hello: to whoever asked
            self._to(self._peer, msg)
        else:  # Load (and the start-up Hello, to nobody yet): every replica
            for peer in list(self.peers):
                self._to(peer, msg)

    def forget(self, peer: bytes, why: str) -> None:
        """A replica is gone: abort its requests (their Finished go nowhere)."""
        if self.peers.pop(peer, None) is None:
            return
        name = self.names.pop(peer, peer.decode(errors="replace"))
        rids = [rid for rid, p in self.owners.items() if p == peer]
        level = logging.WARNING if rids else logging.INFO
        log.log(level, "worker %d: router %s left (%s); aborting its %d requests",
                self.cfg.wid, name, why, len(rids))  # fmt: skip
        now = time.time()
        for rid in rids:
            del self.owners[rid]
            self.core.abort(rid, now, f"router {name} left")

    # ---- input ------------------------------------------------------------------------------

    def recv_all(self, timeout_s: float | None) -> None:
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self.sock.poll(timeout_ms):
            return
        while True:
            try:
                peer, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                msgs = [decode_frame(f) for f in frames]
            except WireError as e:
                log.error("worker %d: dropped a bad frame: %s", self.cfg.wid, e)
                continue
            if len(msgs) != 1:
                log.error("worker %d: dropped a message of %d frames", self.cfg.wid, len(frames))
                continue
            self._peer = peer
            try:
                self.on_peer_message(peer, msgs[0])
            finally:
                self._peer = None

    def on_peer_message(self, peer: bytes, msg: Any) -> None:
        now = time.time()
        new = peer not in self.peers
        self.peers[peer] = now
        if type(msg) is Attach:
            if msg.version != PROTOCOL_VERSION:
                if new or self.names.get(peer) != msg.router:
                    log.error("worker %d: router %s speaks protocol %d, this worker %d: "
                              "ignored", self.cfg.wid, msg.router, msg.version,
                              PROTOCOL_VERSION)  # fmt: skip
                    self.names[peer] = msg.router
                self.peers.pop(peer, None)
                return
            if new or self.names.get(peer) != msg.router:
                self.names[peer] = msg.router
                log.info("worker %d: router %s attached", self.cfg.wid, msg.router)
                self.send(self.hello())
                self._to(peer, self.snapshot(now))
                self.ledger.want_full()  # its view of the rows starts from a snapshot
            return
        if type(msg) in (Detach, Shutdown):  # a replica stopping never stops a shared worker
            self.forget(peer, "it detached")
            return
        if new:  # it spoke before attaching (we restarted): say who we are
            self.send(self.hello())
        if type(msg) is Dispatch:
            rid = msg.req.rid
            tag = msg.tag
            if rid in self.owners or rid in self.core.requests:
                if tag is not None and tag[1] >= 0:  # its replica charged it
                    self.ledger.refused(tag[0], msg.req.client, tag[1])
                self._to(peer, self.refused(msg, "request id already in flight on this worker"))
                return
            self.owners[rid] = peer
            if tag is not None:
                self.ledger_received(tag, msg)
        elif type(msg) is Abort and self.owners.get(msg.rid) != peer:
            return  # not this replica's request
        self.handle(msg)

    def snapshot(self, now: float) -> KVSnapshot:
        """The prefix cache as it is: a fresh encoder's events storing every full page of
        every cached path (shared prefixes once, parents first), so a replica that attaches
        late routes by what is cached here already. It may cross a KV event published just
        before it: the router's tree is a guide, and a page stored twice is stored once."""
        encoder = kv_events.KVEventEncoder(page_size=self.cfg.kv_page_size)
        paths = kv_events.cached_paths(self.core.scheduler.kv.tree.root)
        stored = [("stored", path, 0) for path in paths]
        batch = kv_events.KVEventBatch(ts=now, events=encoder.events(stored))
        return KVSnapshot(self.cfg.wid, now, kv_events.encode_batch(batch))

    def ledger_received(self, tag: tuple[int, int], msg: Dispatch) -> None:
        """Count a tagged dispatch in its replica's row for the client."""
        replica, charge = tag
        if charge < 0:
            log.error("worker %d: dropped a tag with charge %d", self.cfg.wid, charge)
            return
        req = msg.req
        self.ledger.received(req.rid, replica, req.client, charge,
                             interaction=req.interaction_id)  # fmt: skip
        self._ever_tagged = True

    def refused(self, msg: Dispatch, why: str) -> Finished:
        req = msg.req
        return Finished(
            self.cfg.wid, time.time(), req.rid, req.client, FinishReason.REJECTED,
            tuple(req.input_ids), (), error=why,
        )  # fmt: skip

    def flush_out(self, now: float, *, force_load: bool = False) -> None:
        super().flush_out(now, force_load=force_load)
        if now - self._housekeeping_s >= ATTACH_PERIOD_S / 2:
            self._housekeeping_s = now
            for peer, seen in list(self.peers.items()):
                if now - seen > self.peer_timeout_s:
                    self.forget(peer, f"silent for {now - seen:.1f}s")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.kv_pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()


def remote_worker_main(
    cfg: LiveWorkerConfig,
    bind: str,
    keys: ServerKeys | None = None,
    ready: Any = None,
    watch_parent: bool = False,
    peer_timeout_s: float = 15 * ATTACH_PERIOD_S,
    drain_timeout_s: float = 0.0,
) -> None:
    """Process entry point: serve until SIGINT, or SIGTERM: with ``drain_timeout_s`` > 0 the
    first SIGTERM drains (``LiveWorker.begin_drain``: routers choose it for nothing new, what
    it holds finishes, then it exits) and a second stops it at once. ``ready``: an Event set
    once bound; ``watch_parent``: stop when the process that started this one exits (a
    launcher's)."""
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(asctime)s worker{cfg.wid} %(levelname)s %(message)s"
    )
    worker = RemoteWorker(cfg, bind, keys=keys, peer_timeout_s=peer_timeout_s)
    if watch_parent:
        worker.parent = os.getppid()

    def stop(*_: Any) -> None:
        worker.running = False

    def drain(*_: Any) -> None:
        if drain_timeout_s <= 0 or worker.drain_deadline is not None:
            stop()
        else:
            worker.begin_drain(drain_timeout_s)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, drain)
    if ready is not None:
        ready.set()
    try:
        worker.run()
    finally:
        worker.close()
