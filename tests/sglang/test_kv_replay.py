"""KV-event replay (issue 40, item 4) against SGLang 0.5.23's own ``ZmqEventPublisher``.

The router follows a worker's KV events over PUB/SUB, which drops batches (a slow
subscriber past the high-water mark, a reconnect). Before, a gap was only counted: the
router's tree kept missing what the lost batches stored. Now it asks the publisher's replay
socket for them and applies them, in order, before the batch after the gap; a late router
replays the history the buffer still holds from the first batch.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from sgl_fair.messages import Hello
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.service import RouterService
from sgl_fair.transport import Endpoints


def _ports(n: int) -> list[int]:
    import socket

    out = []
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        out.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return out


def _stored(i: int) -> KVEventBatch:
    """Batch i stores one page-1 chain of 4 tokens under the root: 100*i+1 .. 100*i+4."""
    ids = [100 * i + k for k in range(1, 5)]
    hashes = [10_000 * (i + 1) + k for k in range(4)]
    events = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids,
                          block_size=1, lora_id=None)]  # fmt: skip
    return KVEventBatch(ts=time.time(), events=events)


def test_a_gap_is_replayed_from_the_publishers_buffer_and_a_late_router_catches_up():
    pub_port, replay_port, dead_port, quiet_port = _ports(4)
    publisher = ZmqEventPublisher(
        0, endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        buffer_steps=100, bind=True,
    )  # fmt: skip

    async def main() -> None:
        svc = RouterService(
            Router(make_router_policy("rr"), 2),
            Endpoints.ipc(tempfile.mkdtemp(prefix="sgl-fair-replay-")),
            2,
            # nothing on their live streams: the test hands each gap to the router itself
            kv_endpoints=[f"tcp://127.0.0.1:{quiet_port}"] * 2,
            kv_replay_endpoints=[f"tcp://127.0.0.1:{replay_port}", f"tcp://127.0.0.1:{dead_port}"],
        )  # fmt: skip
        await svc.start()
        try:
            for wid in (0, 1):
                svc._on_message(Hello(wid, time.time(), 1, 100_000, "stand-in"))
            for i in range(6):  # published before anyone listens: the SUB never sees them
                publisher.publish(_stored(i))
            await asyncio.sleep(0.5)
            w0, w1 = svc.workers[0], svc.workers[1]
            # worker 0, a late router: its first batch is 6; the buffer holds 0..5
            await svc._kv_gap(w0, 6)
            assert (w0.kv_seq, w0.kv_replayed, w0.kv_gaps) == (5, 6, 0)
            for i in range(6):
                assert svc.router.tree.match([100 * i + k for k in range(1, 5)]).per_worker[0] == 4
            # a gap on a live stream: 7 and 8 lost, 9 arrives
            for i in range(6, 10):
                publisher.publish(_stored(i))
            await asyncio.sleep(0.5)
            w0.kv_seq = 6
            await svc._kv_gap(w0, 9)
            assert (w0.kv_seq, w0.kv_replayed, w0.kv_gaps) == (8, 8, 0)
            assert svc.router.tree.match([801, 802, 803, 804]).per_worker[0] == 4
            # worker 1's publisher keeps no replay (nobody answers): the gap is counted
            w1.kv_seq = 3
            await svc._kv_gap(w1, 6)
            assert (w1.kv_replayed, w1.kv_gaps) == (0, 1)
            assert svc.router.tree.match([401, 402]).per_worker.get(1, 0) == 0
        finally:
            await svc.close(shutdown_workers=False)

    try:
        asyncio.run(main())
    finally:
        publisher.shutdown()
