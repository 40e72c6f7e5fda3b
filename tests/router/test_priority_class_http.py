"""The service class (BROS's RT / BE) and its SLOs over HTTP: body fields, the
``X-Priority-Class`` header, the tenant's default, SGLang's ``priority`` mapping
(``--rt-priority-threshold``), the wire to the worker, the metrics, and a live server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from live_helpers import launched, metric

from sgl_fair.config import ConfigError, parse_tenants
from sgl_fair.launch.config import parse_config
from sgl_fair.messages import Dispatch
from sgl_fair.request import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S, Request, ServiceClass
from sgl_fair.router import protocol as P
from sgl_fair.router.state import Identity, ServerState
from sgl_fair.router.telemetry import Telemetry
from sgl_fair.transport import decode, encode

MSG = [{"role": "user", "content": "hi"}]


def _gen(**kw) -> bytes:
    return json.dumps({"text": "hello", **kw}).encode()


def _chat(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": MSG, **kw}).encode()


def _cmpl(**kw) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", **kw}).encode()


def _hints(endpoint: str, **kw) -> P.Hints:
    if endpoint == "generate":
        return P.parse_generate(_gen(**kw)).items[0].hints
    if endpoint == "chat":
        return P.parse_chat(_chat(**kw)).item.hints
    return P.parse_completion(_cmpl(**kw)).items[0].hints


ENDPOINTS = ("generate", "chat", "completions")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_body_fields_parse_on_every_endpoint(endpoint):
    h = _hints(endpoint, priority_class="rt", ttft_slo_s=0.25, tpot_slo_s=0.05, priority=3)
    assert (h.priority_class, h.ttft_slo_s, h.tpot_slo_s, h.priority) == ("rt", 0.25, 0.05, 3)
    assert _hints(endpoint, priority_class="BE").priority_class == "be"  # case-insensitive
    assert _hints(endpoint) is None
    assert _hints(endpoint, priority_class=None) is None  # null: not given


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("priority_class", "gold", '"rt" or "be"'),
        ("priority_class", 1, '"rt" or "be"'),
        ("ttft_slo_s", 0, "number in (0"),
        ("ttft_slo_s", -1.5, "number in (0"),
        ("tpot_slo_s", "fast", "number in (0"),
        ("tpot_slo_s", 1e9, "number in (0"),
        ("priority", "high", "integer"),
    ],
)
def test_bad_values_are_400_naming_the_field(endpoint, field, value, says):
    with pytest.raises(P.ProtocolError) as e:
        _hints(endpoint, **{field: value})
    assert e.value.status == 400 and e.value.param == field
    assert field in e.value.message and says in e.value.message
    assert e.value.to_dict()["error"]["param"] == field  # OpenAI's error shape


def test_body_beats_header_and_header_applies_alone():
    rt = P.resolve_scheduling(P.Hints(priority_class="rt"), {"x-priority-class": "be"})
    assert rt.service_class is ServiceClass.RT
    be = P.resolve_scheduling(P.Hints(priority_class="be"), {"x-priority-class": "rt"})
    assert be.service_class is ServiceClass.BE
    hdr = P.resolve_scheduling(P.Hints(), {"x-priority-class": " RT "})
    assert hdr.service_class is ServiceClass.RT
    assert P.resolve_scheduling(P.Hints(), {}).service_class is ServiceClass.BE  # default


def test_bad_header_is_400_naming_the_header():
    with pytest.raises(P.ProtocolError) as e:
        P.resolve_scheduling(P.Hints(), {"x-priority-class": "urgent"})
    assert e.value.status == 400 and e.value.param == "X-Priority-Class"
    assert "X-Priority-Class header" in e.value.message
    # a body class means the header is not read at all
    ok = P.resolve_scheduling(P.Hints(priority_class="be"), {"x-priority-class": "urgent"})
    assert ok.service_class is ServiceClass.BE


def test_slos_override_the_defaults():
    s = P.resolve_scheduling(P.Hints(priority_class="rt", ttft_slo_s=1.5), {})
    assert (s.ttft_slo_s, s.tpot_slo_s) == (1.5, DEFAULT_TPOT_SLO_S)
    d = P.resolve_scheduling(P.Hints(priority_class="rt"), {})
    assert (d.ttft_slo_s, d.tpot_slo_s) == (DEFAULT_TTFT_SLO_S, DEFAULT_TPOT_SLO_S)


def test_sglang_priority_maps_only_with_a_threshold():
    hi, lo = P.Hints(priority=7), P.Hints(priority=1)
    # no threshold: priority sets nothing (the tenant default or BE)
    assert P.resolve_scheduling(hi, {}).service_class is ServiceClass.BE
    assert P.resolve_scheduling(hi, {}, tenant_class="rt").service_class is ServiceClass.RT
    # threshold 5: >= 5 is RT, below is BE (beating the tenant's default)
    assert P.resolve_scheduling(hi, {}, rt_priority_threshold=5).service_class.value == "rt"
    assert (
        P.resolve_scheduling(P.Hints(priority=5), {}, rt_priority_threshold=5).priority_class
        == "rt"
    )
    low = P.resolve_scheduling(lo, {}, rt_priority_threshold=5, tenant_class="rt")
    assert low.service_class is ServiceClass.BE
    # SGLang's --schedule-low-priority-values-first: smaller is more urgent
    flipped = P.resolve_scheduling(lo, {}, rt_priority_threshold=5, low_priority_values_first=True)
    assert flipped.service_class is ServiceClass.RT
    # an explicit class (body or header) beats the mapping
    both = P.resolve_scheduling(
        P.Hints(priority=9, priority_class="be"), {}, rt_priority_threshold=5
    )
    assert both.service_class is ServiceClass.BE
    hdr = P.resolve_scheduling(hi, {"x-priority-class": "be"}, rt_priority_threshold=5)
    assert hdr.service_class is ServiceClass.BE


def test_tenant_default_class_in_the_tenants_file():
    table = parse_tenants(
        {
            "defaults": {"priority_class": "rt"},
            "tenant": [{"name": "batch", "priority_class": "be"}, {"name": "web"}],
        }
    )
    assert table.get("batch").priority_class == "be"
    assert table.get("web").priority_class == "rt"  # from [defaults]
    assert table.effective("someone").priority_class == "rt"  # unlisted: [defaults]
    assert parse_tenants({"tenant": [{"name": "x"}]}).get("x").priority_class is None
    for where in (
        {"defaults": {"priority_class": "gold"}},
        {"tenant": [{"name": "x", "priority_class": 1}]},
    ):
        with pytest.raises(ConfigError, match="priority_class"):
            parse_tenants(where)


class _Req:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


def _state(table, **cfg) -> SimpleNamespace:
    return SimpleNamespace(tenants=table, cfg=SimpleNamespace(**cfg))


def test_server_state_applies_tenant_default_and_threshold():
    table = parse_tenants({"tenant": [{"name": "web", "priority_class": "rt"}, {"name": "batch"}]})
    st = _state(table, rt_priority_threshold=10, low_priority_values_first=False)
    web = Identity("web", table.get("web"))
    batch = Identity("batch", table.get("batch"))
    assert ServerState.scheduling(st, _Req({}), None, web).priority_class == "rt"
    assert ServerState.scheduling(st, _Req({}), None, batch).priority_class == "be"
    over = P.Hints(priority=10)
    assert ServerState.scheduling(st, _Req({}), over, batch).priority_class == "rt"
    hdr = _Req({"X-Priority-Class": "be"})  # header names are case-insensitive
    assert ServerState.scheduling(st, hdr, None, web).priority_class == "be"
    # no tenants file: BE unless asked
    assert (
        ServerState.scheduling(_state(None), _Req({}), None, Identity("x", None)).priority_class
        == "be"
    )


def test_a_tenant_kept_to_best_effort_gets_403_for_real_time():
    table = parse_tenants(
        {"tenant": [{"name": "batch", "allow_rt": False}, {"name": "web"}],
         "defaults": {"allow_rt": True}}
    )  # fmt: skip
    st = _state(table, rt_priority_threshold=10, low_priority_values_first=False)
    batch = Identity("batch", table.get("batch"))
    web = Identity("web", table.get("web"))
    assert ServerState.scheduling(st, _Req({}), None, batch).priority_class == "be"
    for hints, headers in (
        (P.Hints(priority_class="rt"), {}),
        (None, {"X-Priority-Class": "rt"}),
        (P.Hints(priority=10), {}),  # SGLang's priority mapped to RT
    ):
        with pytest.raises(P.ProtocolError) as e:
            ServerState.scheduling(st, _Req(headers), hints, batch)
        assert e.value.status == 403 and "allow_rt" in str(e.value)
    rt = ServerState.scheduling(st, _Req({}), P.Hints(priority_class="rt"), web)
    assert rt.priority_class == "rt"
    with pytest.raises(ConfigError, match="contradicts"):
        parse_tenants({"tenant": [{"name": "x", "priority_class": "rt", "allow_rt": False}]})
    with pytest.raises(ConfigError, match="allow_rt"):
        parse_tenants({"tenant": [{"name": "x", "allow_rt": "no"}]})


def test_class_and_slos_travel_to_the_worker():
    req = Request(
        rid="r1", client="c", input_ids=(5, 6, 7), output_len=4, arrival_s=0.0,
        service_class=ServiceClass.RT, ttft_slo_s=0.15, tpot_slo_s=0.03,
        interaction_id="acme/i-1", app="tot", stage=2,
    )  # fmt: skip
    got = decode(encode(Dispatch(0, req, 1.0))).req
    assert got.service_class is ServiceClass.RT
    assert (got.ttft_slo_s, got.tpot_slo_s) == (0.15, 0.03)
    assert (got.interaction_id, got.app, got.stage) == ("acme/i-1", "tot", 2)


def test_launch_flags():
    cfg = parse_config(["--rt-priority-threshold", "5"])
    assert (cfg.rt_priority_threshold, cfg.low_priority_values_first) == (5, False)
    cfg = parse_config(["--rt-priority-threshold", "0", "--schedule-low-priority-values-first"])
    assert (cfg.rt_priority_threshold, cfg.low_priority_values_first) == (0, True)
    assert parse_config([]).rt_priority_threshold is None
    with pytest.raises(SystemExit):
        parse_config(["--schedule-low-priority-values-first"])  # needs the threshold
    cfg = parse_config(
        ["--schedule-policy", "fairserve", "--schedule-policy-opt", "limits.user_limit=3"]
    )
    assert cfg.schedule_policy_opts == {"limits": {"user_limit": 3}}


def test_metrics_count_requests_by_class():
    t = Telemetry()
    t.submitted("acme", "rt")
    t.submitted("acme", "rt")
    t.submitted("acme", "be")
    text = t.render().decode()
    assert metric(text, "sgl_fair_requests_by_class_total", tenant="acme", priority_class="rt") == 2
    assert metric(text, "sgl_fair_requests_by_class_total", tenant="acme", priority_class="be") == 1


# ---- live -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_live_class_reaches_the_bros_worker(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[[tenant]]\nname = "web"\npriority_class = "rt"\n\n[[tenant]]\nname = "batch"\n'
    )
    args = ("--dp", "1", "--schedule-policy", "bros", "--rt-priority-threshold", "5")
    with launched(*args, "--tenants", str(tenants), "--time-scale", "4", tmp_path=tmp_path) as live:
        url = live.url + "/generate"
        sp = {"max_new_tokens": 8}

        def cls(body: dict, headers: dict | None = None) -> str:
            r = httpx.post(url, json={"text": "hi there", "sampling_params": sp, **body},
                           headers=headers or {}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) == 8
            return r.json()["meta_info"]["priority_class"]

        assert cls({"priority_class": "rt", "ttft_slo_s": 0.3}) == "rt"
        assert cls({}) == "be"
        assert cls({}, {"X-Priority-Class": "rt"}) == "rt"
        assert cls({"priority_class": "be"}, {"X-Priority-Class": "rt"}) == "be"
        assert cls({"priority": 7}) == "rt"
        assert cls({"priority": 1}) == "be"
        assert cls({}, {"X-Client-Id": "web"}) == "rt"  # the tenant's default
        assert cls({"priority_class": "be"}, {"X-Client-Id": "web"}) == "be"

        # streaming RT works end to end under BROS
        with httpx.stream(
            "POST", url, timeout=30,
            json={"text": "hi", "sampling_params": sp, "stream": True, "priority_class": "rt"},
        ) as r:  # fmt: skip
            assert r.status_code == 200
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["meta_info"]["priority_class"] == "rt"

        # OpenAI endpoints take the field too; a bad one is a 400 in OpenAI's shape
        chat = {"model": "m", "messages": MSG, "max_tokens": 4}
        r = httpx.post(
            live.url + "/v1/chat/completions", json={**chat, "priority_class": "rt"}, timeout=30
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            live.url + "/v1/chat/completions", json={**chat, "priority_class": "vip"}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority_class"
        r = httpx.post(url, json={"text": "hi"}, headers={"X-Priority-Class": "vip"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority-Class"

        text = httpx.get(live.url + "/metrics", timeout=10).text
        assert metric(text, "sgl_fair_requests_by_class_total", priority_class="rt") == 6
        assert metric(text, "sgl_fair_requests_by_class_total", priority_class="be") == 4
        assert (
            metric(text, "sgl_fair_requests_by_class_total", tenant="web", priority_class="rt") == 1
        )
