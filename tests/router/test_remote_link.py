"""Router replicas over one standalone worker, through ``router/remote_link.py``.

Two ``RouterService`` objects (two replicas) link to the same worker process on loopback tcp:
each gets its own requests' tokens and Finished, both take the worker's Load and KV events
into their routers, and a worker that is killed is declared dead by the replicas and taken
back when a new process binds the same address.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

import pytest
from remote_helpers import free_port_pair, start_worker

from sgl_fair.request import Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.remote_link import RemoteLink
from sgl_fair.router.service import RouterService
from sgl_fair.transport import Endpoints


def replica(name: str, port: int) -> tuple[RouterService, RemoteLink]:
    svc = RouterService(
        Router(make_router_policy("rr"), 1),
        Endpoints.ipc(tempfile.mkdtemp(prefix=f"sgl-fair-{name}-")),
        0,
        heartbeat_timeout_s=3.0,
    )
    return svc, RemoteLink(svc, 0, f"tcp://127.0.0.1:{port}", name=name, attach_period_s=0.2)


def req(rid: str, n: int = 6) -> Request:
    return Request(rid=rid, client="c", input_ids=tuple(range(400, 480)), output_len=n,
                   arrival_s=time.time())  # fmt: skip


async def both_up(*svcs: RouterService, timeout_s: float = 10.0) -> None:
    for svc in svcs:
        await svc.wait_ready(timeout_s)
    await asyncio.sleep(0.3)  # the KV subscriptions are joined (a late one misses events)


@pytest.fixture
def worker_port():
    port = free_port_pair()
    proc = start_worker(port, "--time-scale", "1")
    yield port, proc
    proc.kill()
    proc.wait(5)


def test_two_replicas_share_one_worker(worker_port) -> None:
    port, _proc = worker_port

    async def main() -> None:
        (a, la), (b, lb) = replica("a", port), replica("b", port)
        for svc, link in ((a, la), (b, lb)):
            await svc.start()
            link.start()
        await both_up(a, b)
        ca, cb = a.submit(req("ra"), "t"), b.submit(req("rb", 3), "t")
        await asyncio.wait_for(asyncio.gather(ca.done.wait(), cb.done.wait()), 10)
        assert ca.finished is not None and ca.finished.ok and ca.error is None
        assert cb.finished is not None and cb.finished.ok
        assert len(ca.tokens) == len(ca.finished.output_ids) >= 1
        await asyncio.sleep(0.3)
        for svc in (a, b):
            assert svc.router.load(0) is not None  # Load reached both replicas
            assert svc.workers[0].kv_seq >= 0  # and so did the KV events
            assert not svc.calls
        # each replica's tree holds the prefix its KV events announced (b's too, for ra)
        assert b.router.tree.match(ca.req.input_ids).length > 0
        await la.close()
        await a.close(shutdown_workers=True)  # a replica's Shutdown never stops the worker
        cc = b.submit(req("rc"), "t")
        await asyncio.wait_for(cc.done.wait(), 10)
        assert cc.finished is not None and cc.finished.ok
        await b.close()

    asyncio.run(main())


def test_a_killed_worker_is_dead_then_back_on_restart(worker_port) -> None:
    port, proc = worker_port

    async def main() -> None:
        a, link = replica("a", port)
        await a.start()
        link.start()
        await a.wait_ready(10)
        proc.kill()
        proc.wait(5)
        deadline = time.time() + 5
        while a.workers[0].alive and time.time() < deadline:
            await asyncio.sleep(0.1)
        assert not a.workers[0].alive and a.router.workers == ()
        new = await asyncio.get_running_loop().run_in_executor(
            None, lambda: start_worker(port, "--time-scale", "1")
        )
        try:
            deadline = time.time() + 10
            while not a.workers[0].alive and time.time() < deadline:
                await asyncio.sleep(0.1)
            assert a.workers[0].alive and a.router.workers == (0,)
            call = a.submit(req("after"), "t")
            await asyncio.wait_for(call.done.wait(), 10)
            assert call.finished is not None and call.finished.ok
        finally:
            new.kill()
            new.wait(5)
            await a.close()

    asyncio.run(main())


def test_replicas_share_one_fairness_state_through_the_worker(worker_port) -> None:
    """Replica a serves client x; replica b's view of x's service on the worker, from the
    worker's reports, equals a's own (router/replica_state.py) — and b dispatched nothing."""
    from sgl_fair.router.replica import ReplicaRouter

    port, _proc = worker_port

    def shared(name: str, rid: int) -> tuple[RouterService, RemoteLink]:
        router = ReplicaRouter(make_router_policy("d2lpm"), 1, replica=rid)
        svc = RouterService(
            router, Endpoints.ipc(tempfile.mkdtemp(prefix=f"sgl-fair-{name}-")), 0,
            heartbeat_timeout_s=10.0,
        )  # fmt: skip
        return svc, RemoteLink(svc, 0, f"tcp://127.0.0.1:{port}", name=name)

    async def main() -> None:
        (a, la), (b, lb) = shared("a", 7), shared("b", 9)
        for svc, link in ((a, la), (b, lb)):
            await svc.start()
            link.start()
        await both_up(a, b)
        calls = [a.submit(req(f"x{i}", 300 if i == 0 else 5), "t") for i in range(3)]
        while not calls[0].tokens:  # x0 runs on the worker
            await asyncio.sleep(0.01)
        # b sends a rid a's call holds there now: the worker refuses it (before: a hole in
        # b's dispatch sequence, every later report refused, b's service counted twice)
        dup = b.submit(req("x0", 5), "t")
        await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in [*calls, dup])), 10)
        assert dup.finished is not None and not dup.finished.ok
        out = sum(len(c.finished.output_ids) for c in calls)
        await asyncio.sleep(0.5)  # a few Load reports
        extend, served = a.router.state.service(0, "c")
        assert extend > 0 and served == out
        assert b.router.state.service(0, "c") == (extend, served)
        assert b.router.state.num_reports > 0 and not b.calls
        assert a.router.state.num_refused_reports == b.router.state.num_refused_reports == 0
        for svc, link in ((a, la), (b, lb)):
            await link.close()
            await svc.close()

    asyncio.run(main())
