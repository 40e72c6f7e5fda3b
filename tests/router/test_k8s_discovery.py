"""Workers found in Kubernetes (issue 40, item 5): ``--worker-discovery-k8s SELECTOR``.

A fake API server (stdlib ``http.server`` on loopback, the Pods list API's shape and its
bearer-token check) stands for Kubernetes; the router and the two standalone workers are
real processes. A pod that turns ready joins, a terminating one is drained and removed, a
pod not ready or without the named port is left out, and a router started outside a pod
without ``--k8s-api`` is refused at start, naming the flag.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import httpx
from live_helpers import launched
from remote_helpers import free_port_pair, start_worker

from sgl_fair.router.discovery_k8s import ready_endpoints

TOKEN = "test-sa-token"
SELECTOR = "app=sgl-fair-worker"


def pod(name: str, port: int, *, ready: bool = True, deleting: bool = False, ip="127.0.0.1",
        port_name: str = "dispatch") -> dict:  # fmt: skip
    meta: dict = {"name": name, "labels": {"app": "sgl-fair-worker"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T07:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "worker", "ports": [
            {"name": port_name, "containerPort": port}, {"name": "kv-events",
                                                          "containerPort": port + 1}]}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def test_ready_endpoints_takes_ready_running_pods_at_the_named_port():
    pods = {"items": [
        pod("a", 31000), pod("b", 31000, ip="10.0.0.2"), pod("c", 31000, ready=False),
        pod("d", 31000, deleting=True), pod("e", 31000, port_name="http"),
        pod("f", 31000, ip="fd00::5"), pod("a-again", 31000),
        {"metadata": {}, "status": {"phase": "Pending"}},
    ]}  # fmt: skip
    assert ready_endpoints(pods, "dispatch") == [
        "tcp://10.0.0.2:31000", "tcp://127.0.0.1:31000", "tcp://[fd00::5]:31000"
    ]  # fmt: skip
    assert ready_endpoints({}, "dispatch") == [] and ready_endpoints(None, "dispatch") == []


class FakeKube:
    """``GET /api/v1/namespaces/test/pods?labelSelector=…`` answers ``self.pods`` to a caller
    with the token (401 otherwise); every request's selector is kept."""

    def __init__(self) -> None:
        self.pods: list[dict] = []
        self.selectors: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlparse(self.path)
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"kind": "Status", "code": 401})
                if url.path != "/api/v1/namespaces/test/pods":
                    return self._send(404, {"kind": "Status", "code": 404})
                fake.selectors += parse_qs(url.query).get("labelSelector", [])
                self._send(200, {"kind": "PodList", "items": list(fake.pods)})

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_router_follows_the_ready_pods_of_a_selector(tmp_path):
    kube = FakeKube()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    ports = [free_port_pair(), free_port_pair()]
    procs = [start_worker(p, "--sim-eos", "off") for p in ports]
    try:
        kube.pods = [pod("w0", ports[0]), pod("w1", ports[1], ready=False)]
        args = ("--worker-discovery-k8s", SELECTOR, "--k8s-api", kube.url,
                "--k8s-namespace", "test", "--k8s-token-file", str(token),
                "--k8s-period-s", "0.2", "--startup-timeout", "60")  # fmt: skip
        with launched(*args, tmp_path=tmp_path) as live:

            def alive() -> list[str]:
                return sorted(w["endpoint"] for w in live.info()["workers"] if w["alive"])

            ep0, ep1 = (f"tcp://127.0.0.1:{p}" for p in ports)
            _until(lambda: alive() == [ep0], f"w0 never joined alone: {live.info()['workers']}")
            body = {"input_ids": [7] * 32, "sampling_params": {"max_new_tokens": 4}}
            assert httpx.post(live.url + "/generate", json=body, timeout=30).status_code == 200
            kube.pods = [pod("w0", ports[0]), pod("w1", ports[1])]  # w1 turns ready
            _until(lambda: alive() == [ep0, ep1], "w1 never joined")
            kube.pods = [pod("w0", ports[0], deleting=True), pod("w1", ports[1])]
            _until(lambda: [w["endpoint"] for w in live.info()["workers"]] == [ep1],
                   "w0 was never removed")  # fmt: skip
            assert httpx.post(live.url + "/generate", json=body, timeout=30).status_code == 200
            assert set(kube.selectors) == {SELECTOR}
            for proc in procs:  # not the launcher's: they must not outlive the test
                proc.kill()
                proc.wait(10)
    finally:
        kube.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_outside_a_pod_the_api_server_must_be_given():
    out = subprocess.run(
        [sys.executable, "-m", "sgl_fair.launch", "--worker-discovery-k8s", SELECTOR],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("KUBERNETES")},
    )  # fmt: skip
    assert out.returncode == 2 and "--k8s-api: not in a Kubernetes pod" in out.stderr, out.stderr
