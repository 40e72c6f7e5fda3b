"""A router's link to one remote worker endpoint (``python -m sgl_fair.worker --bind ...``).

The link makes the endpoint worker ``wid`` of a running ``RouterService``, beside the workers
on its own host: a DEALER socket (identity ``NAME-<random>``) takes the service's sends to
``wid`` and feeds what comes back into the service's message handling, renumbered to
``wid``; a SUB socket follows the worker's KV events. The link says ``Attach`` on start and
every ``ATTACH_PERIOD_S`` (so a restarted worker learns of this replica and says Hello
again) and ``Detach`` when it closes. Liveness is the service's: Load is the heartbeat; a
send that finds no connection (``IMMEDIATE``) declares the worker dead at once; a Hello on
a live link (the worker restarted, or forgot this replica) or a Load from another boot is
a death first (``router/liveness.py``): what the worker held of this replica's is gone.

The wire form and the keys are in ``sgl_fair/remote.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from sgl_fair.remote import (
    ATTACH_PERIOD_S,
    ClientKeys,
    Detach,
    attach,
    curve_client,
    encode_control,
    kv_address,
)
from sgl_fair.router.liveness import WorkerState
from sgl_fair.router.service import reap
from sgl_fair.transport import WireError, decode

log = logging.getLogger("sgl_fair.router")


def send_now(sock: zmq.asyncio.Socket, parts: list[Any], copy: bool = True) -> None:
    """Send ``parts`` without waiting (``zmq.Again`` when it cannot go now) through the
    asyncio socket's own API. A send on a socket whose receive another task awaits must go
    this way: zmq's FD is edge-triggered, a send can consume the edge that says "readable",
    and only pyzmq's own send wakes the waiting receive then. The synchronous
    ``zmq.Socket.send`` does not: the link's receive loop could sleep on a Hello or Tokens
    already queued (a worker seen silent under load)."""
    fut = sock.send_multipart(parts, zmq.NOBLOCK, copy=copy)  # resolved at once
    exc = fut.exception()
    if exc is not None:
        raise exc


class _Sender:
    """What the service's ``push[wid]`` must be: a synchronous, non-blocking ``send`` that
    raises ``zmq.Again`` when nobody is connected, and ``close``. (A replica's tag rides in
    its ``Dispatch``: ``Dispatch.tag``.)"""

    def __init__(self, sock: zmq.asyncio.Socket, router: Any) -> None:
        self.sock = sock
        self.router = router

    def send(self, data: Any, flags: int = 0, copy: bool = True) -> None:
        send_now(self.sock, [data], copy=copy)

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger=linger)


class RemoteLink:
    MAX_BACKOFF_S = 10.0

    def __init__(
        self,
        service: Any,
        wid: int,
        endpoint: str,
        *,
        name: str = "router",
        keys: ClientKeys | None = None,
        attach_period_s: float = ATTACH_PERIOD_S,
    ) -> None:
        self.service = service
        self.wid = wid
        self.endpoint = endpoint
        self.kv_endpoint = kv_address(endpoint)
        self.name = name
        self.identity = f"{name}-{uuid.uuid4().hex[:12]}".encode()
        self.keys = keys
        self.attach_period_s = attach_period_s
        self.num_frames = 0
        self.backoff_s = attach_period_s  # the health check's period now
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open the sockets and join the service (its ``start`` has run): worker ``wid``
        takes requests once it says Hello."""
        svc = self.service
        if self.wid in svc.workers:
            raise ValueError(f"worker {self.wid} exists already")
        self.sock = svc.actx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)  # zmq's own reconnects back off too
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.MAX_BACKOFF_S * 1000))
        self.sub = svc.actx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            curve_client(self.sock, self.keys)
            curve_client(self.sub, self.keys)
        self.sock.connect(self.endpoint)
        self.sub.connect(self.kv_endpoint)
        svc.workers[self.wid] = WorkerState(self.wid)
        svc.router.remove_worker(self.wid)  # until it says Hello
        svc.push[self.wid] = _Sender(self.sock, svc.router)
        svc.subs[self.wid] = self.sub
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._recv_loop(), name=f"link-{self.wid}-recv"),
            loop.create_task(svc._kv_loop(self.wid, self.sub), name=f"link-{self.wid}-kv"),
            loop.create_task(self._attach_loop(), name=f"link-{self.wid}-attach"),
        ]
        svc._tasks.extend(self._tasks)  # the service's close cancels them

    async def _attach_loop(self) -> None:
        """The health check: ``Attach`` every period while the worker is up; while it is
        down (never up, or dead) the period doubles up to ``MAX_BACKOFF_S``, and comes back
        to ``attach_period_s`` once it says Hello."""
        while True:
            with contextlib.suppress(zmq.Again):
                send_now(self.sock, [attach(self.name)])
            w = self.service.workers.get(self.wid)
            if w is None or w.alive:
                self.backoff_s = self.attach_period_s
            else:
                self.backoff_s = min(self.MAX_BACKOFF_S, 2 * self.backoff_s)
            await asyncio.sleep(self.backoff_s)

    async def _recv_loop(self) -> None:
        sock, wid, svc = self.sock, self.wid, self.service
        while True:
            frame = await sock.recv(copy=True)
            while True:
                self.num_frames += 1
                try:
                    msg = decode(frame)
                except WireError as e:
                    log.error("worker %d (%s): dropped a bad frame: %s", wid, self.endpoint, e)
                else:
                    if getattr(msg, "worker", wid) != wid:
                        msg = msgspec.structs.replace(msg, worker=wid)
                    try:
                        svc._on_message(msg)
                    except Exception:  # a bug must not kill the loop (its requests would hang)
                        log.exception("error handling %s", type(msg).__name__)
                try:  # whatever else is queued, without a round trip through the loop
                    frame = zmq.Socket.recv(sock, zmq.NOBLOCK)
                except zmq.Again:
                    break

    async def close(self, *, detach: bool = True) -> None:
        """Leave: the worker aborts this replica's requests; the service forgets ``wid``."""
        if detach:
            with contextlib.suppress(zmq.ZMQError):
                send_now(self.sock, [encode_control(Detach(self.name))])
        for t in self._tasks:
            t.cancel()
        await reap(self._tasks)
        svc = self.service
        for t in self._tasks:
            with contextlib.suppress(ValueError):
                svc._tasks.remove(t)
        svc.push.pop(self.wid, None)
        svc.subs.pop(self.wid, None)
        await asyncio.sleep(0.02)  # let the Detach leave
        self.sock.close(linger=0)
        self.sub.close(linger=0)


__all__ = ["RemoteLink"]
