"""Standalone workers (``python -m sgl_fair.worker``) for the tests, on loopback ports."""

from __future__ import annotations

import socket
import subprocess
import sys


def free_port_pair() -> int:
    """A port P with P and P+1 free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def start_worker(port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sgl_fair.worker", "--bind", f"tcp://127.0.0.1:{port}",
           "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # its banner: it is up
    assert "serving routers" in line, proc.stderr.read()
    return proc
