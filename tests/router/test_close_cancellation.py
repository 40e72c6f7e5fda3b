"""Closing the router's service (or a remote link) inside a task that is itself cancelled
must end that task, not swallow its cancellation.

``RouterService.close`` and ``RemoteLink.close`` wait for their own tasks to end. They used to
wait with ``suppress(CancelledError)`` around each ``await task``, which also swallowed a
cancellation aimed at the *caller*: a membership loop cancelled while it closed a drained
worker's link kept looping, and ``asyncio.run``'s clean-up waited for it forever (a hang
found by CI under load, after a test failure).
"""

from __future__ import annotations

import asyncio
import tempfile

import pytest

from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.service import RouterService, reap
from sgl_fair.transport import Endpoints


async def _slow_to_stop(started: asyncio.Event) -> None:
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await asyncio.sleep(0.5)  # takes its time to clean up, as a socket close may
        raise


def test_reap_waits_for_tasks_and_passes_on_its_own_cancellation() -> None:
    async def main() -> None:
        started = asyncio.Event()
        slow = asyncio.create_task(_slow_to_stop(started))
        await started.wait()
        slow.cancel()
        waiter = asyncio.create_task(reap([slow]))
        await asyncio.sleep(0.05)  # the waiter is inside reap, waiting for `slow`
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait([slow])
        boom = asyncio.create_task(asyncio.sleep(0))
        failed = asyncio.create_task(_raise())
        await reap([boom, failed])  # a task's own error is not the caller's
        assert failed.done() and boom.done()

    asyncio.run(main())


async def _raise() -> None:
    raise RuntimeError("a task's bug")


def test_a_cancelled_close_ends_its_task() -> None:
    async def main() -> None:
        svc = RouterService(
            Router(make_router_policy("rr"), 1),
            Endpoints.ipc(tempfile.mkdtemp(prefix="sgl-fair-c-")),
            0,
        )
        await svc.start()
        started = asyncio.Event()
        svc._tasks.append(asyncio.create_task(_slow_to_stop(started)))
        await started.wait()
        closer = asyncio.create_task(svc.close())
        await asyncio.sleep(0.1)  # close is waiting for the slow task
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(closer, 5)
        await svc.close()  # closing again finishes the job

    asyncio.run(main())
