"""KV-event replay: the batches a router missed, from the publisher's own buffer.

SGLang's ``ZmqEventPublisher`` (0.5.23) keeps its last ``buffer_steps`` batches and answers
on a ROUTER socket (``replay_endpoint`` in ``--kv-events-config``): a client sends the first
sequence number it wants, 8 bytes big-endian, and gets every buffered batch from there as
``(topic, seq, payload)`` — the frames of the live stream — then an end marker (seq −1).
A router that sees a gap in a worker's sequence asks for the missing batches before it
applies the one after them, so its tree misses nothing the buffer still holds
(``RouterService._kv_loop``).
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

END_SEQ = -1


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, stop: int, timeout_s: float = 1.0
) -> list[tuple[int, bytes]] | None:
    """The batches ``start <= seq < stop`` the publisher at ``endpoint`` still buffers, in
    order, as ``(seq, payload)``; None when it does not answer within ``timeout_s``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out: list[tuple[int, bytes]] = []
        async with asyncio.timeout(timeout_s):
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 4:  # [b"", topic, seq, payload]
                    return None
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                if start <= seq < stop:
                    out.append((seq, frames[3]))
    except (TimeoutError, zmq.ZMQError):
        return None
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.close(linger=0)
