"""SIGTERM (what systemd, Kubernetes and the SGLang tests send) stops the launcher as cleanly as
Ctrl-C: exit status 0, every worker gone, its private socket folder removed.

Found by the first live SGLang launch test: uvicorn re-raises a captured SIGTERM after its
graceful shutdown, which killed the launcher (status 143) before its clean-up ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_everything_cleanly(tmp_path, sig):
    port = _free_port()
    env = dict(os.environ, TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--dp", "2", "--port", str(port)]
    log = open(tmp_path / "launch.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers
        assert list(tmp_path.glob("sgl-fair-*"))  # its socket folder, while it runs
        proc.send_signal(sig)
        status = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert status == 0, (tmp_path / "launch.log").read_text()[-2000:]
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive
    assert not list(tmp_path.glob("sgl-fair-*"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
