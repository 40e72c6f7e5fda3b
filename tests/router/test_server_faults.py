"""A worker killed under load: zero 5xx, zero lost requests, and the worker comes back.

The hardening issue's measurement: 400 requests at 50/s with a worker ``kill -9``'d after
150 gave 3 HTTP 500s (a send to the dead worker's socket raised before it was marked dead).
Here a smaller run of the same shape, against the real launcher.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
from live_helpers import launched

ARGS = ("--dp", "3", "--time-scale", "0.5", "--gpu", "A10G", "--model", "Llama-2-7B")


def test_a_worker_killed_under_load_costs_no_request_and_is_restarted(tmp_path):
    with launched(*ARGS, "--kv-tokens", "20000", tmp_path=tmp_path) as s:
        victim = s.info()["workers"][0]

        def one(i: int) -> tuple[int, str]:
            body = {"text": f"request {i} " * 8, "sampling_params": {"max_new_tokens": 24}}
            try:
                r = httpx.post(s.url + "/generate", json=body, timeout=60)
            except httpx.HTTPError as e:  # a dropped connection would be a lost request
                return -1, repr(e)
            return r.status_code, r.text

        num = 150
        with cf.ThreadPoolExecutor(48) as pool:
            futs = []
            for i in range(num):  # ~50 requests/s
                futs.append(pool.submit(one, i))
                if i == 50:
                    os.kill(victim["pid"], signal.SIGKILL)
                time.sleep(0.02)
            results = [f.result(timeout=120) for f in futs]
        bad = [(st, text[:200]) for st, text in results if st != 200]
        assert not bad, bad  # every request answered 200: none failed, none lost
        assert all('"finish_reason":{"type":"length"' in text for _, text in results)

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            w0 = s.info()["workers"][0]
            if w0["alive"]:
                break
            time.sleep(0.2)
        assert w0["alive"], w0
        assert w0["pid"] != victim["pid"]  # a new process
        assert w0["restarts"] == 1
        # The restarted worker takes requests again.
        for i in range(6):
            body = {"text": f"after {i}", "sampling_params": {"max_new_tokens": 4}}
            assert httpx.post(s.url + "/generate", json=body, timeout=30).status_code == 200
        assert s.info()["in_flight"] == 0
