"""Start a real ``python -m sgl_fair.launch`` on loopback for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from remote_helpers import stop


def free_port_run(n: int) -> int:
    """A port P with P .. P+n-1 free on 127.0.0.1 now."""
    while True:
        port = free_port()
        if port + n < 65535 and all(_free(port + k) for k in range(1, n)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Live:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()


@contextlib.contextmanager
def launched(*args: str, tmp_path, timeout_s: float = 90.0) -> Iterator[Live]:
    """Run the launcher with ``args``; yield once /health answers; stop it with SIGINT and
    check it exits cleanly (status 0, its socket directory removed, no worker left)."""
    n = int(args[args.index("--router-replicas") + 1]) if "--router-replicas" in args else 1
    port = free_port_run(n)  # P .. P+n-1: one HTTP port per replica
    log_path = str(tmp_path / f"launch-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    sglang = "--worker-url" in args or "sglang" in args  # SGLang servers: no simulated EOS
    if "--sim-eos" not in args and not sglang:  # exact lengths here: no early EOS unless asked
        args = (*args, "--sim-eos", "off")
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    live = Live(url, proc, log_path)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launch exited with {proc.returncode}:\n{live.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch not ready in {timeout_s}s:\n{live.log()}")
            time.sleep(0.2)
        yield live
    finally:
        pids = []
        with contextlib.suppress(Exception):
            pids = [w["pid"] for w in live.info()["workers"] if w["pid"]]
        if not stop(proc):
            log.close()
            raise AssertionError(f"launch did not stop on SIGINT:\n{live.log()}")
        log.close()
    assert proc.returncode == 0, f"launch exited with {proc.returncode}:\n{live.log()}"
    for pid in pids:  # every worker is gone too
        gone = False
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone = True
                break
            time.sleep(0.1)
        assert gone, f"worker pid {pid} survived the launcher"


@contextlib.contextmanager
def launched_replicas(
    *args: str, tmp_path, env: dict[str, str], ready, timeout_s: float = 600.0
) -> Iterator[tuple[Live, list[str]]]:
    """``launched`` with ``--router-replicas 2`` (in ``args``) under ``env`` (set for the
    launcher and the servers it starts); yields ``(live, [replica 0's url, replica 1's])``
    once ``ready(urls)`` holds (an HTTP error counts as not yet), within 120 s."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with launched(*args, tmp_path=tmp_path, timeout_s=timeout_s) as live:
            port = int(live.url.rsplit(":", 1)[1])
            urls = [live.url, f"http://127.0.0.1:{port + 1}"]
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if ready(urls):
                        break
                assert time.monotonic() < deadline, live.log()
                time.sleep(0.5)
            yield live, urls
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") and not labels:  # an unlabelled metric
            total += float(line.rsplit(" ", 1)[1])
            continue
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
