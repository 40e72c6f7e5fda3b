"""A standalone worker stops gracefully on SIGTERM (issue 40, item 3): what Kubernetes sends a
pod it deletes, and what a rolling update of the workers does to each in turn.

Two ``python -m sgl_fair.worker`` processes behind the launcher's router. Worker 0 gets
SIGTERM while it streams a long call: its Load says it drains, the router chooses it for no
new call (they all go to worker 1), the call it holds streams to its last token, and the
process exits 0 once it holds nothing. Before, SIGTERM stopped the worker at once: the call
was cut (tokens had reached the client, so it could not move) and new calls kept being
routed to it until the router's heartbeat timeout. A second SIGTERM stops it at once.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
from live_helpers import launched
from remote_helpers import free_port_pair, start_worker

LONG = 400  # tokens: seconds at time scale 1 on the simulated engine


def _generate(url: str, i: int, n: int = 4) -> httpx.Response:
    body = {"input_ids": [5 + i] * 64, "sampling_params": {"max_new_tokens": n}}
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_sigterm_drains_a_worker_then_it_exits(tmp_path):
    ports = [free_port_pair(), free_port_pair()]
    procs = [start_worker(p, "--sim-eos", "off", "--time-scale", "1") for p in ports]
    try:
        args = [a for p in ports for a in ("--worker-endpoint", f"tcp://127.0.0.1:{p}")]
        with launched(*args, "--startup-timeout", "60", tmp_path=tmp_path) as live:
            assert all(w["alive"] for w in live.info()["workers"])
            long_call: dict = {}

            def stream() -> None:
                long_call["r"] = _generate(live.url, 0, LONG)

            t = threading.Thread(target=stream)
            t.start()
            deadline = time.monotonic() + 30
            while True:
                loads = {w["id"]: w for w in live.info()["workers"]}
                busy = [wid for wid, w in loads.items() if w["queue_len"] > 0]
                if busy:
                    break
                assert time.monotonic() < deadline, loads
                time.sleep(0.05)
            (victim,) = busy
            procs[victim].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "is stopping" not in live.log():
                assert time.monotonic() < deadline, live.log()[-2000:]
                time.sleep(0.05)
            # every new call goes to the other worker while the long one streams on
            info = {w["id"]: w for w in live.info()["workers"]}
            assert info[victim]["stopping"] and not info[1 - victim]["stopping"]
            before = {wid: w["dispatched"] for wid, w in info.items()}
            assert all(_generate(live.url, i).status_code == 200 for i in range(1, 7))
            after = {w["id"]: w["dispatched"] for w in live.info()["workers"]}
            assert after[victim] == before[victim] and after[1 - victim] >= before[1 - victim] + 6
            t.join(60)
            r = long_call["r"]
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == LONG  # never cut
            assert procs[victim].wait(30) == 0  # it left once it held nothing
            procs[1 - victim].kill()  # not the launcher's: it must not outlive the test
            procs[1 - victim].wait(10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_second_sigterm_stops_it_at_once():
    port = free_port_pair()
    proc = start_worker(port, "--sim-eos", "off", "--time-scale", "1")
    try:
        import zmq

        from sgl_fair.messages import Dispatch, Hello, Load
        from sgl_fair.remote import Attach, encode_control
        from sgl_fair.request import Request
        from sgl_fair.transport import decode, encode

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(encode_control(Attach("test", time.time())))
        got: list = []

        def pump(cond, timeout_s: float = 10.0) -> None:
            end = time.time() + timeout_s
            while not cond() and time.time() < end:
                if sock.poll(20):
                    got.append(decode(sock.recv()))
            assert cond(), [type(m).__name__ for m in got]

        pump(lambda: any(type(m) is Hello for m in got))
        req = Request("long", "c", tuple(range(300, 364)), 20_000, time.time())
        sock.send(encode(Dispatch(0, req, time.time())))
        pump(lambda: any(type(m) is Load and m.num_running == 1 for m in got))
        proc.send_signal(signal.SIGTERM)
        pump(lambda: any(type(m) is Load and m.draining for m in got))
        assert proc.poll() is None  # draining: it holds a request
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
        ctx.destroy(linger=0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
