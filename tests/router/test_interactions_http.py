"""Interactions over HTTP (FairServe): ``interaction_id`` / ``app`` / ``stage`` fields and
``X-Interaction-Id`` / ``X-App`` / ``X-Stage`` headers, namespacing under API keys, the load
client's fields, and FairServe's OIT throttling answered with 429 + Retry-After — live."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from live_helpers import launched, metric

from sgl_fair.config import parse_tenants
from sgl_fair.messages import Finished, FinishReason
from sgl_fair.policies.fairserve_oit import Limits, Windows
from sgl_fair.request import Request, ServiceClass
from sgl_fair.router import protocol as P
from sgl_fair.router.state import Identity, ServerState
from sgl_fair.router.telemetry import MAX_APP_LABELS, Telemetry
from sgl_fair.transport import decode, encode
from sgl_fair.workloads.loadclient import request_payload

MSG = [{"role": "user", "content": "hi"}]
BODIES = {
    "generate": lambda **kw: P.parse_generate(json.dumps({"text": "x", **kw}).encode()).items[0],
    "chat": lambda **kw: (
        P.parse_chat(json.dumps({"model": "m", "messages": MSG, **kw}).encode()).item
    ),
    "completions": lambda **kw: P.parse_completion(
        json.dumps({"model": "m", "prompt": "x", **kw}).encode()
    ).items[0],
}


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_interaction_fields_parse(endpoint):
    h = BODIES[endpoint](interaction_id="run-1", app="tot", stage=3).hints
    assert (h.interaction_id, h.app, h.stage) == ("run-1", "tot", 3)
    h = BODIES[endpoint](interaction_id="i" * 256, app="a" * 128, stage=0).hints
    assert len(h.interaction_id) == 256 and len(h.app) == 128 and h.stage == 0


@pytest.mark.parametrize("endpoint", list(BODIES))
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("interaction_id", ""),
        ("interaction_id", "i" * 257),
        ("interaction_id", 12),
        ("interaction_id", "tab\there"),
        ("app", "a" * 129),
        ("app", ["tot"]),
        ("stage", -1),
        ("stage", "2"),
        ("stage", 1.5),
        ("stage", True),
    ],
)
def test_bad_interaction_fields_are_400_naming_the_field(endpoint, field, value):
    with pytest.raises(P.ProtocolError) as e:
        BODIES[endpoint](**{field: value})
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


def test_headers_apply_and_the_body_wins():
    hdrs = {"x-interaction-id": "h-1", "x-app": "judge", "x-stage": "2"}
    s = P.resolve_scheduling(P.Hints(), hdrs)
    assert (s.interaction_id, s.app, s.stage) == ("h-1", "judge", 2)
    s = P.resolve_scheduling(P.Hints(interaction_id="b-1", app="tot", stage=0), hdrs)
    assert (s.interaction_id, s.app, s.stage) == ("b-1", "tot", 0)
    s = P.resolve_scheduling(P.Hints(), {})
    assert (s.interaction_id, s.app, s.stage) == (None, None, 0)


@pytest.mark.parametrize(
    ("header", "value"),
    [("x-stage", "-1"), ("x-stage", "two"), ("x-stage", "99999999"), ("x-app", "a" * 129),
     ("x-interaction-id", "i" * 257)],
)  # fmt: skip
def test_bad_headers_are_400_naming_the_header(header, value):
    with pytest.raises(P.ProtocolError) as e:
        P.resolve_scheduling(P.Hints(), {header: value})
    shown = {"x-stage": "X-Stage", "x-app": "X-App", "x-interaction-id": "X-Interaction-Id"}
    assert e.value.status == 400 and e.value.param == shown[header]


class _Req:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


def test_interaction_ids_are_namespaced_by_the_authenticated_tenant():
    table = parse_tenants(
        {
            "tenant": [
                {"name": "acme", "api_keys": ["sk-a"]},
                {"name": "evil", "api_keys": ["sk-e"]},
            ]
        }
    )
    st = SimpleNamespace(tenants=table, cfg=SimpleNamespace())
    hints = P.Hints(interaction_id="job-42")
    acme = ServerState.scheduling(st, _Req({}), hints, Identity("acme", table.get("acme")))
    evil = ServerState.scheduling(st, _Req({}), hints, Identity("evil", table.get("evil")))
    assert acme.interaction_id == "acme/job-42"
    assert evil.interaction_id == "evil/job-42"  # cannot join or claim acme's
    hdr = ServerState.scheduling(
        st, _Req({"X-Interaction-Id": "job-42"}), None, Identity("evil", table.get("evil"))
    )
    assert hdr.interaction_id == "evil/job-42"
    # without keys identities are not authenticated: ids are taken as given
    open_st = SimpleNamespace(tenants=None, cfg=SimpleNamespace())
    plain = ServerState.scheduling(open_st, _Req({}), hints, Identity("acme", None))
    assert plain.interaction_id == "job-42"


def test_throttles_travel_as_structured_limits():
    """OIT names the limit it hit; it reaches the router in Finished.limit (no text parsing)."""
    w = Windows(Limits(window_s=30, user_limit=1))
    for t in (0.0, 1.0):
        w.count("mallory", "spam", t)
    reason, _, limit, limit_max = w.over_limit("mallory", "spam", 1.0)
    assert (limit, limit_max) == ("user", 1) and "mallory" in reason
    w = Windows(Limits(window_s=60, user_limit=100, app_limits={"judge": 1}))
    w.count("a", "judge", 0.0)
    w.count("b", "judge", 0.5)
    assert w.over_limit("b", "judge", 0.5)[2:] == ("app", 1)
    fin = Finished(0, 1.0, "r", "c", FinishReason.REJECTED, (1,), (), error="over",
                   retry_after_s=3.0, limit=("user", 1, 30.0))  # fmt: skip
    got = decode(encode(fin))
    assert P.throttle_of(got.limit) == P.Throttle("user", 1, 30.0)
    assert P.throttle_of(None) is None


def test_throttle_error_body():
    err = P.ProtocolError(
        429, "request throttled: ...", None, retry_after_s=12.2,
        details={"throttle": P.Throttle("user", 4, 60.0).to_dict()},
    )  # fmt: skip
    body = json.loads(err.body())
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == 429
    assert body["error"]["throttle"] == {"limit": "user", "max_requests": 4, "window_s": 60.0}
    assert err.headers() == {"Retry-After": "13"}


def test_throttle_metric_bounds_app_labels():
    t = Telemetry()
    for i in range(MAX_APP_LABELS + 5):
        t.throttled("mallory", f"app{i}", "user")
    t.throttled("mallory", "app0", "app")
    text = t.render().decode()
    name = "sgl_fair_requests_throttled_total"
    assert metric(text, name, tenant="mallory") == MAX_APP_LABELS + 6
    assert metric(text, name, app="other") == 5
    assert metric(text, name, app="app0", limit="app") == 1


def test_load_client_sends_the_interaction():
    req = Request(
        rid="tot-7/n3", client="alice", input_ids=(1, 2, 3), output_len=4, arrival_s=0.0,
        interaction_id="tot-7", app="tot", stage=2,
    )  # fmt: skip
    body = request_payload(req, "run9-tot-7/n3", interaction_prefix="run9-")
    assert (body["interaction_id"], body["app"], body["stage"]) == ("run9-tot-7", "tot", 2)
    assert "priority_class" not in body  # BE is the default: not sent
    rt = Request(
        rid="x", client="a", input_ids=(1,), output_len=1, arrival_s=0.0,
        service_class=ServiceClass.RT, ttft_slo_s=1.0,
    )  # fmt: skip
    body = request_payload(rt, "x")
    assert body["priority_class"] == "rt" and body["ttft_slo_s"] == 1.0
    assert "tpot_slo_s" not in body and "interaction_id" not in body
    P.parse_generate(json.dumps(body).encode())  # what it sends parses


# ---- live: FairServe's OIT over HTTP ----------------------------------------------------------

FAIRSERVE = (
    "--dp", "1", "--schedule-policy", "fairserve",
    "--schedule-policy-opt", "max_waiting=0",  # overloaded as soon as anything waits
    "--schedule-policy-opt", "limits.user_limit=4",
    "--schedule-policy-opt", "limits.window_s=60",
    "--max-running-requests", "2", "--time-scale", "1",
)  # fmt: skip
SP = {"max_new_tokens": 96, "ignore_eos": True}


@pytest.mark.slow
def test_live_fairserve_throttles_new_interactions_of_an_abusive_user(tmp_path):
    with launched(*FAIRSERVE, tmp_path=tmp_path) as live:
        asyncio.run(_scenario(live.url))
        text = httpx.get(live.url + "/metrics", timeout=10).text
        name = "sgl_fair_requests_throttled_total"
        throttled = metric(text, name, tenant="mallory", app="spam", limit="user")
        assert throttled >= 3
        assert metric(text, name, tenant="alice") == 0
        # FairServe's measures by tenant and app: every throttled call started a new
        # interaction, so nothing was wasted; the benign user was served and never throttled
        m = "sgl_fair_"
        assert metric(text, m + "interactions_throttled_total", tenant="mallory") == throttled
        assert metric(text, m + "tokens_wasted_total") == 0
        assert metric(text, m + "users_total", tenant="mallory", app="spam") == 1
        assert metric(text, m + "users_throttled_total", tenant="mallory", app="spam") == 1
        assert metric(text, m + "users_served_total", tenant="mallory", app="spam") == 1
        assert metric(text, m + "users_total", tenant="alice", app="tot") == 1
        assert metric(text, m + "users_served_total", tenant="alice", app="tot") == 1
        assert metric(text, m + "users_throttled_total", tenant="alice") == 0
        assert metric(text, m + "queue_delay_seconds_count", tenant="alice", app="tot") == 3
        assert metric(text, m + "app_ttft_seconds_count", tenant="alice", app="tot") == 3
        out = metric(text, m + "app_output_tokens_total", tenant="alice", app="tot")
        assert out == 3 * SP["max_new_tokens"]


async def _scenario(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def gen(who: str, headers: dict | None = None, **body) -> httpx.Response:
            h = {"X-Client-Id": who, **(headers or {})}
            payload = {"text": f"{who} asks", "sampling_params": SP, **body}
            return await http.post("/generate", json=payload, headers=h)

        async def alice() -> list[httpx.Response]:
            out = [await gen("alice", interaction_id="tot-1", app="tot", stage=0)]
            hdrs = {"X-Interaction-Id": "tot-1", "X-App": "tot", "X-Stage": "1"}
            out.append(await gen("alice", hdrs))
            out.append(await gen("alice", interaction_id="tot-1", app="tot", stage=2))
            return out

        alice_task = asyncio.ensure_future(alice())
        m1 = asyncio.ensure_future(gen("mallory", interaction_id="m-1", app="spam", stage=0))
        await asyncio.sleep(0.3)  # both interactions started and running
        # the flood: 8 new interactions at once, while the worker is full (overloaded)
        flood = [
            asyncio.ensure_future(gen("mallory", interaction_id=f"f-{i}", app="spam"))
            for i in range(8)
        ]
        await asyncio.sleep(0.2)  # the flood's accepted calls wait: still overloaded
        # a streamed new interaction gets the 429 status (not a 200 stream with an error),
        # and so does the OpenAI endpoint, in its error shape
        payload = {"text": "again", "sampling_params": SP, "stream": True, "app": "spam"}
        async with http.stream(
            "POST", "/generate", json=payload, headers={"X-Client-Id": "mallory"}
        ) as r:
            body = await r.aread()
            assert r.status_code == 429, body
            assert "Retry-After" in r.headers
            assert json.loads(body)["error"]["throttle"]["limit"] == "user"
        chat = {"model": "m", "messages": MSG, "max_tokens": 8, "stream": True,
                "user": "mallory", "app": "spam"}  # fmt: skip
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 429 and "Retry-After" in r.headers, r.text
        assert set(r.json()["error"]) >= {"message", "type", "code"}

        flood = await asyncio.gather(*flood)
        throttled = [r for r in flood if r.status_code == 429]
        assert throttled, [r.status_code for r in flood]
        assert all(r.status_code in (200, 429) for r in flood), [r.text for r in flood]
        for r in throttled:
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == 429
            assert err["throttle"] == {"limit": "user", "max_requests": 4, "window_s": 60.0}
            assert "over its limit of 4 requests per 60 s" in err["message"]

        # a call continuing mallory's interaction in flight is never throttled: it waits
        m1_next = await gen("mallory", interaction_id="m-1", app="spam", stage=1)
        assert m1_next.status_code == 200, m1_next.text
        assert (await m1).status_code == 200
        # the benign user's multi-call interaction completes, every call 200
        for r in await alice_task:
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) == SP["max_new_tokens"]


@pytest.mark.slow
def test_live_tokens_wasted_when_rpm_cuts_an_interaction(tmp_path):
    """rpm refuses the second call of an interaction: the first call's prompt + output
    tokens are wasted (the user gets no final answer), on /metrics by tenant and app."""
    rpm = ("--dp", "1", "--schedule-policy", "rpm", "--schedule-policy-opt", "limit=1")
    with launched(*rpm, tmp_path=tmp_path) as live:
        h = {"X-Client-Id": "bob"}
        body = {"text": "bob asks", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
                "interaction_id": "agent-1", "app": "agent"}  # fmt: skip
        first = httpx.post(live.url + "/generate", json=body, headers=h, timeout=60)
        assert first.status_code == 200, first.text
        meta = first.json()["meta_info"]
        second = httpx.post(live.url + "/generate", json={**body, "stage": 1}, headers=h,
                            timeout=60)  # fmt: skip
        assert second.status_code == 429, second.text
        text = httpx.get(live.url + "/metrics", timeout=10).text
        m = "sgl_fair_"
        spent = meta["prompt_tokens"] + meta["completion_tokens"]
        assert metric(text, m + "tokens_wasted_total", tenant="bob", app="agent") == spent
        assert metric(text, m + "interactions_throttled_total", tenant="bob", app="agent") == 1
        assert metric(text, m + "users_throttled_total", tenant="bob", app="agent") == 1
        assert metric(text, m + "requests_throttled_total") == 0  # not FairServe's OIT
