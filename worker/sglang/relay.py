"""The bridge's plumbing, apart from what it says: tokens batched per event-loop pass, whether
a process runs, the event loop, a bridge process's entry point (``bridge_main``); its streams
are read by ``sse_client.py``.

``TokenBatch``: SGLang streams one event per request per decode step; sending each as its
own message costs the bridge, libzmq's I/O threads and the router a wake-up per token.
The tokens of every stream read in one pass of the loop leave as one ``Tokens`` message, at
the end of that pass (``call_soon``), or before anything the bridge sends meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from sgl_fair.messages import Tokens


class TokenBatch:
    def __init__(self, wid: int, send: Callable[[Any], None]) -> None:
        self.wid = wid
        self.send = send  # the bridge's link: encoded onto zmq, or handed to the router
        self.items: list[tuple[str, tuple[int, ...]]] = []  # read, not yet sent
        self.due: asyncio.Handle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, rid: str, ids: tuple[int, ...]) -> None:
        """New tokens of ``rid``: sent at the end of this loop pass with the others'."""
        self.items.append((rid, ids))
        if self.due is None:
            loop = self.loop
            if loop is None:  # once: get_running_loop costs a getpid() per call on 3.11
                loop = self.loop = asyncio.get_running_loop()
            self.due = loop.call_soon(self.flush)

    def flush(self) -> None:
        if self.due is not None:
            self.due.cancel()
            self.due = None
        if self.items:
            items, self.items = self.items, []
            self.send(Tokens(self.wid, time.time(), tuple(items)))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def run_loop(coro: Any) -> int:
    """``coro`` on uvloop where it is installed (as the router runs; a cheaper loop pass per
    stream chunk than asyncio's own), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # optional (not on Windows)
        return asyncio.run(coro)
    return uvloop.run(coro)


def bridge_main(cfg: Any) -> None:
    """Process entry point (multiprocessing spawn target); exits non-zero when its server
    is gone, so the router's process watch marks the worker dead."""
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(asctime)s bridge{cfg.wid} %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher shuts us down in order
    code = 1

    from sgl_fair.worker.sglang.bridge import Bridge

    async def main() -> int:
        bridge = Bridge(cfg)
        try:
            return await bridge.run()
        finally:
            bridge.close()

    try:
        code = run_loop(main())
    finally:
        sys.stdout.flush()
    if code:
        sys.exit(code)


__all__ = ["TokenBatch", "bridge_main", "process_alive", "run_loop"]
