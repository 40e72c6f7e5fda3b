"""RouterService liveness on real zmq sockets, with stand-in workers driven by the test.

What the hardening issue asked for: a stalled router loop is not a dead worker; a worker
declared silent that speaks again is taken back (and told to drop what moved elsewhere); a
send to a worker whose process is gone never fails the dispatch; with no worker left the
error carries a Retry-After; a worker process that exits is restarted with backoff.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import zmq

from sgl_fair.messages import Abort, Dispatch, Hello, Load
from sgl_fair.request import Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.service import NoWorkerError, RouterService
from sgl_fair.transport import Endpoints, decode, encode


class FakeWorker:
    """The worker end of the sockets: says Hello, sends Load heartbeats, records what the
    router sends it. ``close_input()`` is what a killed process leaves behind."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, wid: int) -> None:
        self.wid = wid
        self.out = ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.connect(endpoints.router_in)
        self.inp = ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.LINGER, 0)
        self.inp.connect(endpoints.worker_in(wid))
        self.received: list = []

    def hello(self) -> None:
        self.out.send(encode(Hello(self.wid, time.time(), os.getpid(), 10_000, "fake")))

    def beat(self) -> None:
        self.out.send(encode(Load(self.wid, time.time(), 0, 0, 0, 0, 10_000)))

    def drain(self) -> list:
        while True:
            try:
                self.received.append(decode(self.inp.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return self.received

    def close_input(self) -> None:
        self.inp.close(linger=0)


def zmq_thread_beater(
    ctx: zmq.Context, endpoints: Endpoints, wid: int, stop: threading.Event
) -> threading.Thread:
    """Worker ``wid``'s heartbeats from a thread of its own (a worker is another process:
    the router's stall does not stop it)."""

    def run() -> None:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(endpoints.router_in)
        while not stop.wait(0.05):
            out.send(encode(Load(wid, time.time(), 0, 0, 0, 0, 10_000)))
        out.close(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class FakeProcess:
    def __init__(self) -> None:
        self.alive = True
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.alive


async def started(tmp_path, n: int, **kw) -> tuple[RouterService, list[FakeWorker], zmq.Context]:
    endpoints = Endpoints.ipc(str(tmp_path / "ipc"))
    router = Router(make_router_policy("rr"), n)
    svc = RouterService(router, endpoints, n, **kw)
    await svc.start()
    ctx = zmq.Context()
    workers = [FakeWorker(ctx, endpoints, i) for i in range(n)]
    for w in workers:
        w.hello()
    await svc.wait_ready(5.0)
    await asyncio.sleep(0.1)  # let the PULL connections settle
    return svc, workers, ctx


async def stopped(svc: RouterService, workers: list[FakeWorker], ctx: zmq.Context) -> None:
    await svc.close(shutdown_workers=False)
    for w in workers:
        w.out.close(linger=0)
        if not w.inp.closed:
            w.inp.close(linger=0)
    ctx.term()


def req(rid: str) -> Request:
    return Request(rid=rid, client="a", input_ids=(1, 2, 3), output_len=4, arrival_s=0.0)


async def beat_for(workers: list[FakeWorker], seconds: float, every_s: float = 0.05) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for w in workers:
            w.beat()
        await asyncio.sleep(every_s)


def test_a_stalled_router_loop_kills_no_worker(tmp_path):
    """The loop blocks for 4× the heartbeat timeout while the workers keep beating: their
    heartbeats sit in the socket, so nobody is declared dead."""

    async def main() -> None:
        svc, workers, ctx = await started(tmp_path, 2, heartbeat_timeout_s=0.5)
        try:
            await beat_for(workers, 0.3)
            stop = threading.Event()
            beats = [zmq_thread_beater(ctx, svc.endpoints, w.wid, stop) for w in workers]

            async def handler() -> None:  # one burst request's parse + tokenize, ~1 ms
                end = time.monotonic() + 0.001
                while time.monotonic() < end:
                    pass

            # The stall: 2,000 handlers ready at once run in one loop iteration (~2 s,
            # 4× the timeout) while the workers keep beating from their own threads.
            await asyncio.gather(*(handler() for _ in range(2000)))
            await asyncio.sleep(1.0)
            stop.set()
            for t in beats:
                t.join()
            assert [w.alive for w in svc.workers.values()] == [True, True]
            assert [w.death for w in svc.workers.values()] == [None, None]
            assert svc.router.workers == (0, 1)
        finally:
            await stopped(svc, workers, ctx)

    asyncio.run(main())


def test_the_watchdog_reads_queued_heartbeats_before_it_judges(tmp_path):
    """Deterministic form of the stall: heartbeats wait in the socket, unread, while the
    (fake) clock runs past the timeout. Worker 0 beat, worker 1 did not: only 1 is dead.
    A round that itself ran late judges nobody."""

    async def main() -> None:
        now = [0.0]
        svc, workers, ctx = await started(
            tmp_path, 2, heartbeat_timeout_s=1.0, clock=lambda: now[0]
        )
        try:
            workers[0].beat()
            time.sleep(0.2)  # blocking: the frame crosses zmq but the loop does not read it
            now[0] = 5.0
            svc.watch_tick(now[0])
            assert svc.workers[0].alive, svc.workers[0].death
            assert not svc.workers[1].alive and "no message for 5.0s" in svc.workers[1].death
            now[0] = 20.0
            svc.watch_tick(now[0], late_s=10.0)  # the router itself was stalled for 10 s
            assert svc.workers[0].alive
        finally:
            await stopped(svc, workers, ctx)

    asyncio.run(main())


def test_a_silent_worker_is_taken_back_when_it_speaks_again(tmp_path):
    async def main() -> None:
        svc, workers, ctx = await started(tmp_path, 2, heartbeat_timeout_s=0.4)
        try:
            svc.submit(req("r0"), "a")
            svc.submit(req("r1"), "a")
            held_by_0 = [rid for rid, c in svc.calls.items() if c.worker == 0]
            assert held_by_0
            await beat_for([workers[1]], 1.0)  # worker 0 silent
            assert not svc.workers[0].alive and "no message" in svc.workers[0].death
            moved = [svc.calls[rid].worker for rid in held_by_0]
            assert moved == [1] * len(held_by_0)  # re-dispatched to the live one
            await beat_for(workers, 0.5)  # worker 0 speaks again
            assert svc.workers[0].alive and svc.workers[0].death is None
            assert svc.workers[0].num_revived == 1
            assert 0 in svc.router.workers
            await asyncio.sleep(0.1)
            aborts = [m for m in workers[0].drain() if isinstance(m, Abort)]
            assert sorted(m.rid for m in aborts) == sorted(held_by_0)
        finally:
            await stopped(svc, workers, ctx)

    asyncio.run(main())


def test_dispatch_to_a_gone_worker_goes_elsewhere_and_none_left_is_503_retry_after(tmp_path):
    async def main() -> None:
        svc, workers, ctx = await started(tmp_path, 2, heartbeat_timeout_s=30.0)
        try:
            workers[0].close_input()  # killed: the router has not noticed yet
            await asyncio.sleep(0.2)
            for i in range(6):  # round robin would pick worker 0 for half of them
                call = svc.submit(req(f"r{i}"), "a")
                assert call.worker == 1
            assert not svc.workers[0].alive and "no peer" in svc.workers[0].death
            await asyncio.sleep(0.1)  # the frames cross zmq's I/O thread
            got = [m.req.rid for m in workers[1].drain() if isinstance(m, Dispatch)]
            assert sorted(got) == [f"r{i}" for i in range(6)]  # none lost
            workers[1].close_input()
            await asyncio.sleep(0.2)
            with pytest.raises(NoWorkerError) as e:
                svc.submit(req("late"), "a")
            assert e.value.retry_after_s > 0
            assert "late" not in svc.calls
        finally:
            await stopped(svc, workers, ctx)

    asyncio.run(main())


def test_an_exited_worker_is_restarted_with_backoff(tmp_path):
    async def main() -> None:
        started_at: list[float] = []
        procs = [FakeProcess(), FakeProcess()]

        def restarter(wid: int) -> FakeProcess:
            started_at.append(time.monotonic())
            procs[wid] = FakeProcess()
            return procs[wid]

        svc, workers, ctx = await started(
            tmp_path, 2, heartbeat_timeout_s=30.0, restarter=restarter,
            restart_backoff_s=(0.2, 1.0),
        )  # fmt: skip
        try:
            for i, p in enumerate(procs):
                svc.watch_process(i, p)
            died = []
            for expected_backoff in (0.2, 0.4, 0.8, 1.0):  # doubling, capped
                procs[0].alive = False
                procs[0].exitcode = -9
                died.append(time.monotonic())
                while len(started_at) < len(died):
                    await asyncio.sleep(0.02)
                waited = started_at[-1] - died[-1]
                assert expected_backoff - 0.05 <= waited <= expected_backoff + 0.5, waited
                assert not svc.workers[0].alive  # until it says Hello
                workers[0].hello()
                await asyncio.sleep(0.1)
                assert svc.workers[0].alive and 0 in svc.router.workers
            assert svc.workers[0].num_restarts == 4
        finally:
            await stopped(svc, workers, ctx)

    asyncio.run(main())
