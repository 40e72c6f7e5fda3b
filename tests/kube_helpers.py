"""A fake Kubernetes API server for the discovery tests (``router/discovery_k8s.py``): the
Pods list API's shape and its bearer-token check, on loopback (stdlib ``http.server``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

TOKEN = "test-sa-token"
SELECTOR = "app=sgl-fair-worker"


def pod(name: str, port: int, *, ready: bool = True, deleting: bool = False, ip="127.0.0.1",
        port_name: str = "dispatch", kv: bool = True) -> dict:  # fmt: skip
    """A pod of the Pods API: its container's port ``port_name`` (and ``kv-events`` after it,
    unless not ``kv``), ready or not, being deleted or not."""
    meta: dict = {"name": name, "labels": {"app": "sgl-fair-worker"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T07:00:00Z"
    ports = [{"name": port_name, "containerPort": port}]
    if kv:
        ports.append({"name": "kv-events", "containerPort": port + 1})
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "worker", "ports": ports}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


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
