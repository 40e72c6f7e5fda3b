"""How a bridge talks to its router: over zmq from a process of its own (:class:`ZmqLink`), or
by handing message objects across inside the router's own process and event loop
(:class:`LocalLink`, ``--bridges router``, the launcher's default).

Side by side with SGLang's gateway (issue 39), a streamed token crossing a bridge process cost
the bridge a zmq send (a wake-up of libzmq's I/O thread, a TCP write) and the router a wake-up,
a zmq receive and a decode, on top of reading SGLang's stream and writing the client's: the
hop was most of the relay's CPU per token. Inside the router the bridge is the same code
(:class:`~sgl_fair.worker.sglang.bridge.Bridge`), its messages the same objects, never encoded:
the router hands it each message on the next pass of the loop (``call_soon``: never inside the
router's own handler), it hands the router each of its own at once. A bridge process still
spreads the reading of many fast streams over cores (``--bridges process``).

:class:`HostedBridge` is what the router's process watch reads of a bridge inside it, as it
reads a ``multiprocessing.Process``: alive while its task runs, its exit code after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from sgl_fair.transport import Endpoints, WireError, decode, encode

log = logging.getLogger("sgl_fair.bridge")


class ZmqLink:
    """A bridge process's sockets: PULL from the router's ``worker_in(wid)``, PUSH to its
    ``router_in``."""

    in_process = False

    def __init__(self, wid: int, endpoints: str) -> None:
        ep = Endpoints(endpoints)
        self.wid = wid
        self.actx = zmq.asyncio.Context()
        self.sctx = zmq.Context()
        self.inbox = self.actx.socket(zmq.PULL)
        self.inbox.connect(ep.worker_in(wid))
        self.outbox = self.sctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(ep.router_in)

    def send(self, msg: Any) -> None:
        self.outbox.send(encode(msg), copy=False)

    async def serve(self, handle: Callable[[Any], None]) -> None:
        """The router's messages, each to ``handle``, until cancelled."""
        while True:
            frame = await self.inbox.recv(copy=True)
            try:
                msg = decode(frame)
            except WireError as e:
                log.error("bridge %d: dropped a bad frame: %s", self.wid, e)
                continue
            handle(msg)

    def close(self) -> None:
        for sock in (self.inbox, self.outbox):
            sock.close()
        self.actx.term()
        self.sctx.term()


class LocalLink:
    """A bridge inside the router's process: ``deliver(msg)`` is the router's handler
    (``RouterService.deliver``); the router calls the bridge's ``handle`` itself."""

    in_process = True

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self.send = deliver

    serve = None  # nothing to receive: the router hands messages over

    def close(self) -> None:
        pass


class HostedBridge:
    """A bridge running as a task of the router's loop, seen as a process is: ``is_alive``,
    ``exitcode`` (what ``RouterService.watch_process`` reads)."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"bridge-{self.bridge.cfg.wid}"
        )

    async def _run(self) -> int:
        try:
            return await self.bridge.run()
        except Exception:  # a bug ends this worker (its watch sees code 1), never the router
            log.exception("bridge %d failed", self.bridge.cfg.wid)
            self.bridge.exit_code = self.bridge.exit_code or 1
            return self.bridge.exit_code
        finally:
            self.bridge.close()

    def handle(self, msg: Any) -> None:
        """A message from the router, taken on the loop's next pass."""
        if self.is_alive():
            asyncio.get_running_loop().call_soon(self.bridge.handle, msg)

    def is_alive(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def exitcode(self) -> int | None:
        if self.task is None or not self.task.done():
            return None
        return self.bridge.exit_code if not self.task.cancelled() else -15


__all__ = ["HostedBridge", "LocalLink", "ZmqLink"]
