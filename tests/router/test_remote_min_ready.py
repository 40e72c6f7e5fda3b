"""A router replica starts with the workers it has (issue 40, item 3): ``--min-ready-workers``.

Before, a replica over two standalone workers waited for both Hellos and exited 1 when one
was down: rolling the router out while a GPU node is down was a crash loop. With
``--min-ready-workers 1`` it serves with the one that is up, and the other joins when it
starts, as a worker restarted at run time does.
"""

from __future__ import annotations

import time

import httpx
from live_helpers import launched
from remote_helpers import free_port_pair, start_worker


def _generate(url: str, i: int) -> httpx.Response:
    body = {"input_ids": [5 + i] * 64, "sampling_params": {"max_new_tokens": 4}}
    return httpx.post(url + "/generate", json=body, timeout=30)


def test_a_replica_serves_with_one_of_two_workers_and_takes_the_other_when_it_starts(tmp_path):
    up, down = free_port_pair(), free_port_pair()
    first = start_worker(up, "--sim-eos", "off")
    second = None
    try:
        args = ("--worker-endpoint", f"tcp://127.0.0.1:{up}",
                "--worker-endpoint", f"tcp://127.0.0.1:{down}",
                "--min-ready-workers", "1", "--startup-timeout", "60")  # fmt: skip
        with launched(*args, tmp_path=tmp_path) as live:
            assert "serving with 1 of 2 workers" in live.log()
            ok = _generate(live.url, 0)
            assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
            second = start_worker(down, "--sim-eos", "off")
            # its link's Attach backs off up to 10 s while the worker is down; a loaded CI
            # machine (2 cores under a second suite) took longer than 30 s once
            deadline = time.monotonic() + 60
            while True:
                workers = live.info()["workers"]
                if all(w["alive"] for w in workers):
                    break
                assert time.monotonic() < deadline, workers
                time.sleep(0.3)
            assert all(_generate(live.url, i).status_code == 200 for i in range(6))
            for proc in (first, second):  # not the launcher's: they must not outlive the test
                proc.kill()
                proc.wait(10)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_without_it_a_missing_worker_fails_the_start_naming_it(tmp_path):
    import subprocess
    import sys

    up, down = free_port_pair(), free_port_pair()
    first = start_worker(up, "--sim-eos", "off")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "sgl_fair.launch", "--port", "0",
             "--worker-endpoint", f"tcp://127.0.0.1:{up}",
             "--worker-endpoint", f"tcp://127.0.0.1:{down}", "--startup-timeout", "3"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 1 and "workers [1] did not start" in out.stderr, out.stderr
        bad = subprocess.run(
            [sys.executable, "-m", "sgl_fair.launch", "--worker-endpoint",
             f"tcp://127.0.0.1:{up}", "--min-ready-workers", "2"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "--min-ready-workers must be in 1..1" in bad.stderr
    finally:
        first.kill()
        first.wait(10)
