"""``router.notify.Notify`` behaves as ``asyncio.Event`` for what a call in flight asks of it:
a set before the wait returns at once, every waiter wakes, ``clear`` makes the next wait
wait, and a cancelled wait leaves no waiter behind."""

from __future__ import annotations

import asyncio

import pytest

from sgl_fair.router.notify import Notify


@pytest.mark.parametrize("make", [Notify, asyncio.Event])
def test_notify_behaves_as_an_event(make):
    async def main():
        n = make()
        assert not n.is_set()
        n.set()
        assert await asyncio.wait_for(n.wait(), 1) is True  # set before: at once
        n.clear()
        waiters = [asyncio.ensure_future(n.wait()) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)
        n.set()
        assert await asyncio.wait_for(asyncio.gather(*waiters), 1) == [True] * 3
        n.clear()
        w = asyncio.ensure_future(n.wait())
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert len(n._waiters) == 0
        n.set()  # nothing left to wake: no error
        assert n.is_set()

    asyncio.run(main())
