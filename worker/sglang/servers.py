"""SGLang server processes the launcher owns: start them, watch them, stop them.

Each server is ``python -m sglang.launch_server ...`` in a session of its own (SGLang forks a
scheduler and a detokenizer per server, so stopping one means signalling its whole process
group), with stdout and stderr in a log file whose tail goes into start-up errors. On Linux a
server is also killed when the launcher dies without stopping it (``PR_SET_PDEATHSIG``; SGLang's
own children follow their parent the same way), so a crashed launcher leaves no GPU held.

Pure subprocess handling: no sglang import.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class ServerProcess:
    """One SGLang server: its command, its log file and (once started) its process."""

    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: str
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def exitcode(self) -> int | None:
        """The exit status once it exited (reaping it), else None."""
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"
        return "\n".join(text.splitlines()[-num_lines:])

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)  # its session leader's pid is the group id


class ServerGroup:
    """The SGLang servers of one launch."""

    def __init__(self, servers: Sequence[ServerProcess], held: Sequence[Any] = ()) -> None:
        self.servers = list(servers)
        # Sockets holding the servers' ports from the moment they were chosen (the launcher's
        # ``hold_ports``): an outgoing connection must not take one as its ephemeral port in
        # the seconds before a server binds it. Closed with ``stop``.
        self.held = list(held)

    def start(self) -> None:
        for server in self.servers:
            server.start()

    def first_exit(self) -> ServerProcess | None:
        """A server that has exited, if any."""
        return next((s for s in self.servers if s.exitcode() is not None), None)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every server's process group, wait up to ``timeout_s``, then SIGKILL the
        groups (a server's children may outlive it briefly)."""
        started = [s for s in self.servers if s.popen is not None]
        for s in started:
            if s.exitcode() is None:
                s.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for s in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.popen.wait(max(0.0, deadline - time.monotonic()))
        for s in started:
            s.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.popen.wait(5.0)
        for sock in self.held:
            sock.close()
        self.held = []


class WatchedWorker:
    """What the router's process watch sees for one SGLang worker: its bridge process and its
    server, alive only while both are (``RouterService.watch_process`` reads ``is_alive`` and
    ``exitcode``)."""

    def __init__(self, bridge: Any, server: ServerProcess) -> None:
        self.bridge = bridge
        self.server = server

    def is_alive(self) -> bool:
        return self.server.exitcode() is None and self.bridge.is_alive()

    @property
    def exitcode(self) -> str | int | None:
        code = self.server.exitcode()
        if code is not None:
            return f"{code} (SGLang server {self.server.index}; log {self.server.log_path})"
        return self.bridge.exitcode


__all__ = ["ServerGroup", "ServerProcess", "WatchedWorker"]
