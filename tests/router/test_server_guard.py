"""Operator endpoints need an admin; a body nested thousands deep is a 400, not a 500."""

from __future__ import annotations

import httpx
import pytest
from live_helpers import launched

pytestmark = pytest.mark.slow

TENANTS = """
[[tenant]]
name = "acme"
api_keys = ["sk-acme"]

[[tenant]]
name = "ops"
api_keys = ["sk-ops"]
admin = true
"""


def test_operator_views_need_an_admin_key_and_deep_json_is_400(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    args = ("--dp", "1", "--time-scale", "inf", "--tenants", str(path))
    with launched(*args, "--admin-loopback", "off", "--admin-key", "op-secret",
                  tmp_path=tmp_path) as s:  # fmt: skip
        for endpoint in ("/metrics", "/server_info", "/get_server_info"):
            r = httpx.get(s.url + endpoint, timeout=10)
            assert r.status_code == 401 and "admin" in r.json()["error"]["message"]
            r = httpx.get(s.url + endpoint, headers={"Authorization": "Bearer sk-acme"})
            assert r.status_code == 403
            for key in ("sk-ops", "op-secret"):
                r = httpx.get(s.url + endpoint, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, (endpoint, key)
        r = httpx.post(s.url + "/flush_cache", headers={"Authorization": "Bearer sk-acme"})
        assert r.status_code == 403
        deep = "[" * 20_000 + "]" * 20_000
        r = httpx.post(
            s.url + "/generate", content=deep, timeout=30,
            headers={"Authorization": "Bearer sk-acme", "Content-Type": "application/json"},
        )  # fmt: skip
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])
        assert r.json()["error"]["message"]
        r = httpx.post(
            s.url + "/generate", json={"text": "still fine"}, timeout=30,
            headers={"Authorization": "Bearer sk-acme"},
        )  # fmt: skip
        assert r.status_code == 200


def test_without_tenant_keys_abort_all_is_for_operators(tmp_path):
    """Nobody owns a request without keys: any caller may abort a rid it knows, but
    aborting everyone's requests needs the admin key (loopback trust is off here)."""
    args = ("--dp", "1", "--time-scale", "inf", "--admin-loopback", "off")
    with launched(*args, "--admin-key", "op-secret", tmp_path=tmp_path) as s:
        r = httpx.post(s.url + "/abort_request", json={"abort_all": True}, timeout=10)
        assert r.status_code == 401 and "abort_all" in r.json()["error"]["message"]
        bad = {"Authorization": "Bearer nope"}
        r = httpx.post(s.url + "/abort_request", json={"abort_all": True}, headers=bad)
        assert r.status_code == 403
        r = httpx.post(s.url + "/abort_request", json={"rid": "someone"}, timeout=10)
        assert r.status_code == 200 and r.json() == {"aborted": 0}
        ok = {"Authorization": "Bearer op-secret"}
        r = httpx.post(s.url + "/abort_request", json={"abort_all": True}, headers=ok)
        assert r.status_code == 200 and r.json() == {"aborted": 0}
