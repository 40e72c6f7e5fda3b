"""Links that notice every loss (issue 40, item 2): a worker that lost a replica's state —
it forgot the replica after a silence, or it restarted, with the same pid or not — says
Hello again, and the replica treats any Hello on a live link as that loss: its calls there
move on or fail (never hang), its routing state for the worker starts again.

The first test runs a real worker process; the others a stand-in worker on real zmq sockets
(a same-pid restart cannot be made with a real process).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from remote_helpers import free_port_pair, start_worker

from sgl_fair.messages import Hello, Load
from sgl_fair.remote import decode_frame
from sgl_fair.request import Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.remote_link import RemoteLink
from sgl_fair.router.service import RouterService
from sgl_fair.transport import Endpoints, encode


def _replica(port: int, *, attach_period_s: float, heartbeat_s: float):
    svc = RouterService(
        Router(make_router_policy("rr"), 1),
        Endpoints.ipc(tempfile.mkdtemp(prefix="sgl-fair-link-")),
        0,
        heartbeat_timeout_s=heartbeat_s,
    )
    link = RemoteLink(svc, 0, f"tcp://127.0.0.1:{port}", name="r", attach_period_s=attach_period_s)
    return svc, link


def _req(rid: str, n: int) -> Request:
    return Request(rid=rid, client="c", input_ids=tuple(range(300, 380)), output_len=n,
                   arrival_s=time.time())  # fmt: skip


def test_a_worker_that_forgot_the_replica_never_leaves_its_calls_hanging():
    """The worker forgets a replica silent past its peer timeout (1 s here) and aborts its
    calls; the replica, whose heartbeat timeout is longer (60 s), still thinks it alive.
    Before: the aborted calls' Finished went nowhere and the calls awaited forever, holding
    the router's in-flight rids. Now the worker's Hello on the replica's next Attach tells
    it: the calls are re-dispatched or failed, and nothing is left in flight."""
    port = free_port_pair()
    proc = start_worker(port, "--time-scale", "1", "--peer-timeout-s", "1", "--sim-eos", "off")

    async def main() -> None:
        svc, link = _replica(port, attach_period_s=8.0, heartbeat_s=60.0)
        await svc.start()
        link.start()
        try:
            await svc.wait_ready(30)  # its first Attach may go before the connection is up
            # long enough not to finish by themselves in the test's 25 s
            calls = [svc.submit(_req(f"long{i}", 8000), "t") for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in calls)), 25)
            for c in calls:  # moved on with an error or finished elsewhere: never silent
                assert c.error is not None or (c.finished is not None and c.finished.ok)
            assert not svc.calls and not svc.router.inflight
        finally:
            await link.close()
            await svc.close()

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(5)


class _StandIn:
    """A worker's ROUTER socket and nothing else: answers a replica's Attach with the
    Hello it is told to, and sends what the test says."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.peer: bytes | None = None

    async def attach(self) -> None:
        """Wait for the replica's Attach."""
        while True:
            peer, frame = await self.sock.recv_multipart()
            self.peer = peer
            if type(decode_frame(frame)).__name__ == "Attach":
                return

    async def send(self, msg) -> None:
        assert self.peer is not None
        await self.sock.send_multipart([self.peer, encode(msg)])


@contextlib.asynccontextmanager
async def _attached(port: int):
    """A replica linked to a stand-in worker on ``port`` that has said Hello (pid 1, boot
    11): ``(worker, service)``, closed after."""
    ctx = zmq.asyncio.Context()
    worker = _StandIn(ctx, port)
    svc, link = _replica(port, attach_period_s=0.2, heartbeat_s=30.0)
    await svc.start()
    link.start()
    try:
        await asyncio.wait_for(worker.attach(), 10)
        await worker.send(_hello(1, 11))
        await svc.wait_ready(10)
        yield worker, svc
    finally:
        await link.close()
        await svc.close()
        ctx.destroy(linger=0)


def _hello(pid: int, boot: int) -> Hello:
    return Hello(0, time.time(), pid, 100_000, "stand-in", boot=boot)


def _load(boot: int) -> Load:
    return Load(0, time.time(), 0, 0, 0, 0, 100_000, boot=boot)


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (lambda: _hello(1, 22), "restarted"),  # pid 1 of its container both times
        (lambda: _hello(1, 11), "lost this router's state"),  # it forgot the replica
        (lambda: _load(22), "restarted"),  # a Load from another boot
    ],
)  # fmt: skip
def test_any_hello_on_a_live_link_or_a_new_boot_is_a_loss(second, why, caplog):
    port = free_port_pair()

    async def main() -> None:
        async with _attached(port) as (worker, svc):
            svc.router.tree.insert((1, 2, 3, 4), 0)  # what the old process cached
            await worker.send(second())
            deadline = time.monotonic() + 5
            while "is gone" not in caplog.text and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert why in caplog.text, caplog.text
            assert svc.router.tree.match((1, 2, 3, 4)).per_worker.get(0, 0) == 0

    with caplog.at_level("WARNING", logger="sgl_fair.router"):
        asyncio.run(main())


def test_the_boot_id_travels_in_hello_and_load():
    from sgl_fair.transport import decode

    h, ld = _hello(7, 2**62 + 5), _load(2**62 + 5)
    assert decode(encode(h)).boot == 2**62 + 5 and decode(encode(ld)).boot == 2**62 + 5
    assert msgspec.structs.replace(ld, boot=0).boot == 0


def test_a_restarted_worker_is_told_to_abort_what_moved_away():
    """The dispatch that reaches a restarted worker makes it say Hello, and it runs that call
    too; the router moves (or fails) the call, and now also aborts it on the new process, so
    it does not run to completion there for nobody."""
    port = free_port_pair()

    async def main() -> None:
        async with _attached(port) as (worker, svc):
            call = svc.submit(_req("moved", 50), "t")
            while True:  # the stand-in receives its Dispatch
                _peer, frame = await asyncio.wait_for(worker.sock.recv_multipart(), 10)
                if type(decode_frame(frame)).__name__ == "Dispatch":
                    break
            await worker.send(_hello(1, 22))  # restarted (the same pid)
            await asyncio.wait_for(call.done.wait(), 10)  # moved or failed: never hangs
            aborted = None
            while aborted is None:
                _peer, frame = await asyncio.wait_for(worker.sock.recv_multipart(), 10)
                msg = decode_frame(frame)
                if type(msg).__name__ == "Abort":
                    aborted = msg.rid
            assert aborted == "moved"

    asyncio.run(main())
