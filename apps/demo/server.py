"""The demos' server: ``python -m sgl_fair.launch`` as a child process, up until they are done."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from sgl_fair.launch import free_ports


@contextlib.contextmanager
def serving(args: Sequence[str], log_path: Path, *, timeout_s: float = 120) -> Iterator[str]:
    """Start the server with ``args`` (log in ``log_path``), yield its URL once ``/health``
    answers, stop it (SIGINT, then kill after 30 s) on the way out."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--port", str(port), *args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, server, log_path, timeout_s)
        yield url
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def _wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"demo: the server exited ({proc.returncode}):\n{log_path.read_text()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"demo: the server did not start in {timeout_s:.0f}s:\n{log_path.read_text()}")
