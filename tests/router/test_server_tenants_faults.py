"""Live server: API-key tenants (auth, no impersonation, limits) and worker failures."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest
from live_helpers import launched, metric

pytestmark = pytest.mark.slow

TENANTS = """
[[tenant]]
name = "acme"
api_keys = ["sk-acme"]
weight = 2.0

[[tenant]]
name = "globex"
api_keys = ["sk-globex"]
max_inflight = 2

[[tenant]]
name = "ops"
api_keys = ["sk-ops"]
admin = true
"""


def test_api_keys_identify_tenants_and_cannot_be_spoofed(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    with launched("--dp", "1", "--tenants", str(path), "--time-scale", "2", tmp_path=tmp_path) as s:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}}
        r = httpx.post(s.url + "/generate", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(
            s.url + "/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=30
        )
        assert r.status_code == 401
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": "Llama-3.1-8B", "prompt": "x", "max_tokens": 2, "user": "acme"},
            headers={"Authorization": "Bearer sk-globex"},
            timeout=30,
        )
        assert r.status_code == 200
        # globex tries to pass as acme through every identity channel it has.
        spoof = {**body, "routing_key": "acme"}
        r = httpx.post(
            s.url + "/generate",
            json=spoof,
            headers={"Authorization": "Bearer sk-globex", "X-Client-Id": "acme"},
            timeout=30,
        )
        assert r.status_code == 200
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert metric(metrics, "sgl_fair_tenant_requests_total", tenant="globex") == 2
        assert metric(metrics, "sgl_fair_tenant_requests_total", tenant="acme") == 0
        # Limits: globex may have 2 requests in flight; the third is refused with 429.
        long = {"text": "slow", "sampling_params": {"max_new_tokens": 300}}
        hdr = {"Authorization": "Bearer sk-globex"}
        with cf.ThreadPoolExecutor(3) as pool:
            futs = [
                pool.submit(httpx.post, s.url + "/generate", json=long, headers=hdr, timeout=60)
                for _ in range(2)
            ]
            time.sleep(0.5)
            r = httpx.post(s.url + "/generate", json=long, headers=hdr, timeout=60)
            assert r.status_code == 429 and "max_inflight" in r.json()["error"]["message"]
            assert "Retry-After" in r.headers
            assert all(f.result().status_code == 200 for f in futs)
        # Admin-only: flushing the cache needs an admin tenant.
        hdr = {"Authorization": "Bearer sk-acme"}
        assert httpx.post(s.url + "/flush_cache", headers=hdr, timeout=10).status_code == 403
        hdr = {"Authorization": "Bearer sk-ops"}
        assert httpx.post(s.url + "/flush_cache", headers=hdr, timeout=10).status_code == 200
        info = s.info()
        assert info["auth"] is True and {t["name"] for t in info["tenants"]} == {
            "acme",
            "globex",
            "ops",
        }
        assert "sk-" not in str(info)  # keys never leak


def test_killed_worker_loses_no_request(tmp_path):
    """Kill a worker mid-run: every request completes or gets an error; routing stops.
    (With restarts off: tests/router/test_server_faults.py covers the restart.)"""
    args = ("--dp", "2", "--time-scale", "0.5", "--gpu", "A10G", "--model", "Llama-2-7B")
    args += ("--worker-restart-backoff", "0")
    with launched(*args, "--kv-tokens", "10000", tmp_path=tmp_path) as s:
        victim = s.info()["workers"][0]

        def one(i: int) -> tuple[int, str]:
            stream = i % 2 == 0
            body = {
                "text": f"request number {i} " * 5,
                "sampling_params": {"max_new_tokens": 40},
                "stream": stream,
            }
            try:
                r = httpx.post(s.url + "/generate", json=body, timeout=60)
            except httpx.HTTPError as e:  # a dropped connection would be a lost request
                return -1, repr(e)
            return r.status_code, r.text

        with cf.ThreadPoolExecutor(24) as pool:
            futs = [pool.submit(one, i) for i in range(24)]
            time.sleep(1.0)
            os.kill(victim["pid"], signal.SIGKILL)
            t_kill = time.monotonic()
            dead_seen = None
            while time.monotonic() - t_kill < 5:
                w0 = s.info()["workers"][0]
                if not w0["alive"]:
                    dead_seen = time.monotonic() - t_kill
                    break
                time.sleep(0.05)
            results = [f.result(timeout=90) for f in futs]
        assert dead_seen is not None and dead_seen < 2.0, dead_seen
        for status, text in results:
            assert status != -1, text  # every request got an HTTP answer
            if status == 200:
                if text.startswith("data:"):  # stream: ends with a finish or an error event
                    assert "[DONE]" in text
                    # Tokens already streamed cannot be retried elsewhere: the stream ends
                    # with an abort naming the dead worker (or an error event).
                    ok = '"finish_reason":{"type":"length"' in text
                    assert ok or ('"type":"abort"' in text and "worker 0" in text), text
                else:
                    assert '"finish_reason":{"type":"length"' in text
            else:
                assert status in (502, 503), (status, text)
                assert "worker 0" in text
        assert sum(st == 200 for st, _ in results) >= 12  # re-dispatched ones completed
        info = s.info()
        w0 = info["workers"][0]
        assert w0["alive"] is False and "exit" in w0["death"]
        assert w0["tree_tokens"] == 0  # its tree entries are gone
        assert info["in_flight"] == 0
        # New requests go to the surviving worker only.
        for i in range(4):
            body = {"text": f"after {i}", "sampling_params": {"max_new_tokens": 4}}
            r = httpx.post(s.url + "/generate", json=body, timeout=30)
            assert r.status_code == 200
        info = s.info()
        assert info["workers"][0]["queue_len"] == 0 and info["workers"][1]["alive"]


def test_local_admission_control_is_429_with_retry_after(tmp_path):
    """RPM's refusal travels worker -> router -> client as 429 + Retry-After (not 400)."""
    args = ("--dp", "1", "--schedule-policy", "rpm", "--schedule-policy-opt", "limit=2")
    with launched(*args, "--time-scale", "inf", tmp_path=tmp_path) as s:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        hdr = {"X-Client-Id": "eager"}
        codes = [
            httpx.post(s.url + "/generate", json=body, headers=hdr, timeout=30) for _ in range(3)
        ]
        assert [r.status_code for r in codes] == [200, 200, 429], [r.text for r in codes]
        err = codes[2].json()["error"]
        assert err["type"] == "rate_limit_error" and "exceeded 2 requests" in err["message"]
        assert int(codes[2].headers["Retry-After"]) >= 1
        other = httpx.post(s.url + "/generate", json=body, headers={"X-Client-Id": "calm"})
        assert other.status_code == 200  # per client
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert metric(metrics, "sgl_fair_tenant_rejections_total", tenant="eager") == 1
