"""``Notify``: what ``asyncio.Event`` does for a call in flight (``set``, ``clear``, ``is_set``,
``wait``), bound to the running loop at its first wait instead of looking the loop up at every
wait. On Python 3.11 that lookup asks the OS for the process id each time (a fork check in
``asyncio.get_running_loop``): one system call per streamed token, ~4 % of the router's CPU in
``bench/bench_relay.py``'s profile."""

from __future__ import annotations

import asyncio


class Notify:
    __slots__ = ("_flag", "_waiters", "_loop")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[asyncio.Future[bool]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(True)

    def clear(self) -> None:
        self._flag = False

    async def wait(self) -> bool:
        if self._flag:
            return True
        loop = self._loop
        if loop is None:  # once: the loop the call lives on
            loop = self._loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        try:
            await fut
            return True
        finally:
            self._waiters.remove(fut)


__all__ = ["Notify"]
