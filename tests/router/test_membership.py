"""Membership at run time (``router/membership.py``) on real worker processes over tcp.

A worker added to a running router takes requests once it says Hello; a drained worker takes
no new ones while its own finish, then it is removed; one removed without draining has its
requests moved to the others; an endpoint nobody serves stays ``starting`` and its health
checks back off.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator

import pytest
from remote_helpers import free_port_pair, start_worker

from sgl_fair.request import Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.membership import Membership, MembershipError
from sgl_fair.router.service import RouterService
from sgl_fair.transport import Endpoints


def req(rid: str, n: int = 6) -> Request:
    return Request(rid=rid, client="c", input_ids=tuple(range(500, 540)), output_len=n,
                   arrival_s=time.time())  # fmt: skip


@pytest.fixture
def two_workers():
    ports = [free_port_pair(), free_port_pair()]
    procs = [start_worker(p, "--time-scale", "1", "--sim-eos", "off") for p in ports]
    yield [f"tcp://127.0.0.1:{p}" for p in ports]
    for p in procs:
        p.kill()
        p.wait(5)


@contextlib.asynccontextmanager
async def running() -> AsyncIterator[tuple[RouterService, Membership]]:
    """A started service and membership, closed whatever the test does (a failed test that
    left them open would leave zmq contexts for the garbage collector)."""
    svc = RouterService(
        Router(make_router_policy("rr"), 1),
        Endpoints.ipc(tempfile.mkdtemp(prefix="sgl-fair-m-")),
        0,
        heartbeat_timeout_s=10.0,
    )
    m = Membership(svc, name="t", period_s=0.05)
    await svc.start()
    m.start()
    try:
        yield svc, m
    finally:
        await m.close()
        await svc.close()


async def until(cond, timeout_s: float = 30.0) -> None:  # generous: CI runs loaded
    end = time.time() + timeout_s
    while not cond():
        assert time.time() < end, "timed out"
        await asyncio.sleep(0.05)


def test_remove_without_draining_moves_requests(two_workers) -> None:
    a_ep, b_ep = two_workers

    async def main() -> None:
        async with running() as (svc, m):
            a, b = m.add(a_ep), m.add(b_ep)
            await until(lambda: m.state(a) == m.state(b) == "ready")
            calls = [svc.submit(req(f"r{i}", 400), "t") for i in range(2)]  # running at removal
            on_b = next(c for c in calls if c.worker == b)
            await m.remove(b, drain=False)
            assert b not in m.members and svc.router.workers == (a,)
            await until(lambda: all(c.done.is_set() for c in calls))
            # on_b had streamed nothing to a client: it moved to a and finished there
            assert on_b.worker == a and on_b.finished is not None and on_b.finished.ok
            with pytest.raises(MembershipError) as gone:
                await m.remove(b)
            assert gone.value.status == 404

    asyncio.run(main())


def test_an_endpoint_nobody_serves_is_starting_and_backs_off() -> None:
    async def main() -> None:
        async with running() as (svc, m):
            wid = m.add(f"tcp://127.0.0.1:{free_port_pair()}")
            link = m.members[wid].link
            link.attach_period_s = link.backoff_s = 0.05
            await asyncio.sleep(0.6)
            row = next(r for r in m.describe() if r["id"] == wid)
            assert row["state"] == "starting" and row["health_check_period_s"] >= 0.4
            with pytest.raises(MembershipError) as bad:
                m.add("127.0.0.1:1")
            assert bad.value.status == 400 and "tcp://HOST:PORT" in str(bad.value)

    asyncio.run(main())


def test_add_drain_and_remove_at_run_time(two_workers) -> None:
    a_ep, b_ep = two_workers

    async def main() -> None:
        async with running() as (svc, m):
            a = m.add(a_ep)
            await until(lambda: m.state(a) == "ready")
            with pytest.raises(MembershipError) as dup:
                m.add(a_ep)
            assert dup.value.status == 409
            b = m.add(b_ep)
            assert m.state(b) == "starting"
            await until(lambda: m.state(b) == "ready")
            long_b = None
            calls = [svc.submit(req(f"r{i}", 400), "t") for i in range(4)]  # still running at drain
            assert {c.worker for c in calls} == {a, b}  # both take requests
            long_b = next(c for c in calls if c.worker == b)
            m.drain(b)
            assert m.state(b) == "draining"
            later = [svc.submit(req(f"later{i}"), "t") for i in range(4)]
            assert {c.worker for c in later} == {a}  # nothing new for a draining worker
            await until(lambda: long_b.done.is_set())
            assert long_b.finished is not None and long_b.finished.ok  # its own finish
            await until(lambda: b not in m.members)  # then it is removed
            assert b not in svc.workers and svc.router.workers == (a,)
            await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in calls + later)), 30)
            assert all(c.finished is not None and c.finished.ok for c in calls + later)

    asyncio.run(main())


def test_a_watched_endpoints_file(two_workers, tmp_path) -> None:
    a_ep, b_ep = two_workers
    path = tmp_path / "workers.txt"
    path.write_text(f"# the fleet\n{a_ep}\n")

    async def main() -> None:
        async with running() as (svc, m):
            m.watch(str(path), period_s=0.1)
            assert [r["endpoint"] for r in m.describe()] == [a_ep]
            await until(lambda: m.state(0) == "ready")
            added = m.add(b_ep)  # an operator's own: the file leaves it alone
            await until(lambda: m.state(added) == "ready")
            path.write_text("")  # a_ep leaves the file: drained, then removed
            await until(lambda: [r["endpoint"] for r in m.describe()] == [b_ep])
            path.write_text(f"{a_ep}  # back\nnot-an-endpoint\n")
            await until(lambda: sorted(r["endpoint"] for r in m.describe()) == sorted([a_ep, b_ep]))

    asyncio.run(main())


def test_a_replica_that_joins_late_learns_the_cache_already_there(two_workers) -> None:
    """Router A fills a worker's prefix cache; router B attaches afterwards. KV events are
    published as they happen, so B would know nothing of that cache until new requests come
    (D2LPM then routes an old prefix away from the worker holding it). The worker sends a
    replica that attaches its cache as it is; B's tree holds the prefix before any request."""
    a_ep, _ = two_workers
    prompt = tuple(range(700, 764))  # four 16-token pages

    async def main() -> None:
        async with running() as (svc_a, m_a):
            a = m_a.add(a_ep)
            await until(lambda: m_a.state(a) == "ready")
            call = svc_a.submit(
                Request(rid="fill", client="c", input_ids=prompt, output_len=4,
                        arrival_s=time.time()), "t",
            )  # fmt: skip
            await asyncio.wait_for(call.done.wait(), 30)
            await until(lambda: svc_a.router.tree.match(prompt).per_worker.get(a, 0) >= 48)
            async with running() as (svc_b, m_b):
                b = m_b.add(a_ep)
                await until(lambda: m_b.state(b) == "ready")
                await until(lambda: svc_b.router.tree.match(prompt).per_worker.get(b, 0) >= 48)

    asyncio.run(main())
