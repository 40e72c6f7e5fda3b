"""Idle and slow-header connections cannot exhaust the server.

Before: uvicorn never closes a connection that has not sent a full request, so 20,000 idle
or slow-header sockets reached the file limit and normal requests then failed. Here 3,000
idle sockets and a slowloris against a server capped at 1,000 connections: a normal
request still succeeds, and the idle sockets are closed (the cap at once, the rest by the
header timeout).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from live_helpers import launched

pytestmark = pytest.mark.slow


def test_idle_and_slow_connections_leave_room_for_real_requests(tmp_path):
    args = ("--dp", "1", "--time-scale", "inf", "--max-connections", "1000",
            "--http-header-timeout", "2")  # fmt: skip
    with launched(*args, tmp_path=tmp_path) as s:
        port = int(s.url.rsplit(":", 1)[1])
        idle = []
        try:
            for _ in range(3000):
                sock = socket.create_connection(("127.0.0.1", port))
                idle.append(sock)
            slow = socket.create_connection(("127.0.0.1", port))
            slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never end
            for i in range(3):
                r = httpx.post(s.url + "/generate", json={"text": f"hi {i}"}, timeout=10)
                assert r.status_code == 200
            time.sleep(3.0)  # past the header timeout
            closed = 0
            for sock in [*idle, slow]:
                try:  # never blocks: b"" = closed by the server, no data = still open
                    closed += sock.recv(1, socket.MSG_DONTWAIT) == b""
                except ConnectionResetError:
                    closed += 1
                except BlockingIOError:
                    pass  # still open
            assert closed == len(idle) + 1  # every idle socket, and the slowloris, were closed
            r = httpx.post(s.url + "/generate", json={"text": "after"}, timeout=10)
            assert r.status_code == 200
        finally:
            for sock in idle:
                sock.close()
