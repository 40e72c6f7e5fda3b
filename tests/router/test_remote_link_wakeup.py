"""The remote link's sends must not lose its receive's wake-up (session 16's hang, issue 34).

zmq's socket FD is edge-triggered. An asyncio socket whose ``recv`` is waiting is woken by
the loop when the FD turns readable. A *synchronous* ``zmq.Socket.send`` on that same socket
processes zmq's pending commands, which consumes the edge of a message that arrived in the
meantime: the FD never turns readable again and the waiting ``recv`` sleeps on a queued
message (a remote worker's Hello or Tokens; the worker then looked silent and was declared
dead). ``send_now`` sends through pyzmq's asyncio API, which re-checks the socket's events
after the send and wakes the waiting ``recv``. Deterministic: the message is queued before
the send, while the loop is kept busy.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from sgl_fair.router.remote_link import send_now


async def _receive_after_a_send(send) -> bool:
    """Whether a waiting ``recv`` gets a message that arrived just before a send on its
    socket (within 1 s)."""
    ctx = zmq.asyncio.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        a.bind("inproc://wakeup")
        b.connect("inproc://wakeup")
        await b.send(b"warm")
        assert await a.recv() == b"warm"
        waiting = asyncio.ensure_future(a.recv())
        await asyncio.sleep(0.05)  # the receive waits, its FD watched by the loop
        zmq.Socket.send(b, b"message")  # arrives ...
        time.sleep(0.05)  # ... while the loop is busy elsewhere
        send(a)  # the link sends on the socket its receive waits on
        try:
            return await asyncio.wait_for(waiting, 1.0) == b"message"
        except asyncio.TimeoutError:
            return False
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_send_now_keeps_the_waiting_receive_awake():
    """``send_now`` keeps the wake-up where a plain synchronous send loses it. The plain send
    is the rig's control: where this pyzmq does not lose the wake-up, the rig cannot tell the
    two apart and the test says so (skip) instead of passing on nothing."""
    plain = [
        asyncio.run(_receive_after_a_send(lambda s: zmq.Socket.send(s, b"out"))) for _ in range(3)
    ]
    if any(plain):
        pytest.skip(f"pyzmq {zmq.__version__} does not lose the wake-up here: no hazard to show")
    got = [asyncio.run(_receive_after_a_send(lambda s: send_now(s, [b"out"]))) for _ in range(3)]
    assert got == [True] * 3
