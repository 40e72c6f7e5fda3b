"""Workers found in Kubernetes (issue 40, item 5): ``--worker-discovery-k8s SELECTOR``.

A fake API server (stdlib ``http.server`` on loopback, the Pods list API's shape and its
bearer-token check) stands for Kubernetes; the router and the two standalone workers are
real processes. A pod that turns ready joins, a terminating one is drained and removed, a
pod not ready or without the named port is left out, and a router started outside a pod
without ``--k8s-api`` is refused at start, naming the flag.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
from kube_helpers import SELECTOR, TOKEN, FakeKube, pod
from live_helpers import launched
from remote_helpers import free_port_pair, start_worker

from sgl_fair.router.discovery_k8s import ready_endpoints


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
            _until(lambda: alive() == sorted([ep0, ep1]), "w1 never joined")
            kube.pods = [pod("w0", ports[0], deleting=True), pod("w1", ports[1])]
            _until(lambda: [w["endpoint"] for w in live.info()["workers"]] == [ep1],
                   "w0 was never removed")  # fmt: skip
            assert httpx.post(live.url + "/generate", json=body, timeout=30).status_code == 200
            assert set(kube.selectors) == {SELECTOR}
            metrics = httpx.get(live.url + "/metrics", timeout=10).text
            assert 'sgl_fair_workers{state="ready"} 1.0' in metrics
            assert "sgl_fair_workers_added_total 2.0" in metrics
            assert "sgl_fair_workers_removed_total 1.0" in metrics
            lists = next(ln for ln in metrics.splitlines()
                         if ln.startswith("sgl_fair_discovery_lists_total"))  # fmt: skip
            assert float(lists.split()[-1]) >= 3
            assert "sgl_fair_discovery_failures_total 0.0" in metrics
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
