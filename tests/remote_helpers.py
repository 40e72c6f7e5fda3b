"""Standalone workers (``python -m sgl_fair.worker``) for the tests, on loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


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
    """Start a worker and wait for its banner. Its output goes to a file, not a pipe: a pipe
    that nobody reads fills up and blocks the worker mid-run (it then looks dead)."""
    cmd = [sys.executable, "-m", "sgl_fair.worker", "--bind", f"tcp://127.0.0.1:{port}",
           "--log-level", os.environ.get("SGLFAIR_TEST_WORKER_LOG", "warning"), *extra]  # fmt: skip
    fd, log_path = tempfile.mkstemp(prefix="sgl-fair-worker-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60.0
    while "serving routers" not in Path(log_path).read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"worker did not start: {Path(log_path).read_text()}")
        time.sleep(0.05)
    return proc


def free_port_run(n: int) -> int:
    """A port P with P .. P+n-1 free on 127.0.0.1 (replicas' HTTP ports, a gateway's)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n >= 65535:
            continue
        free = True
        for k in range(1, n):
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + k))
                except OSError:
                    free = False
        if free:
            return port
    raise RuntimeError("no free port run")


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> bool:
    """SIGINT ``proc`` and wait for it; kill it if it takes longer. False: it had to be
    killed."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False
