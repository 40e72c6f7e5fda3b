"""The SGLang bridge: its pieces (pure), then end to end against a stand-in SGLang server.

The stand-in is our own ``launch --backend sim``: it serves SGLang's native API (streaming
``/generate`` with cumulative ``output_ids`` and ``meta_info``, ``/abort_request``,
``/flush_cache``, ``/health``) and publishes KV events in SGLang's format. The router under test
is ``launch --worker-url <stand-in>``: HTTP -> router -> zmq -> bridge -> HTTP -> stand-in. A
recording proxy between the bridge and the stand-in shows exactly what the bridge sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))  # live_helpers
from live_helpers import (  # noqa: E402
    Live,
    free_port,
    launched,
    metric,  # noqa: E402
)

from sgl_fair.messages import FinishReason  # noqa: E402
from sgl_fair.request import INFLIGHT_PARAM, Request  # noqa: E402
from sgl_fair.worker.sglang.http_api import (  # noqa: E402
    DEFAULT_RETRY_AFTER_S,
    SSEParser,
    StreamState,
    error_message,
    generate_body,
    status_outcome,
)

# ---- pieces ------------------------------------------------------------------------------------


def test_the_bridge_and_the_launcher_never_import_sglang():
    code = (
        "import sys; sys.modules['sglang'] = None; sys.modules['torch'] = None\n"
        "import sgl_fair.worker.sglang.bridge, sgl_fair.worker.sglang.servers, sgl_fair.launch"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _req(**kw) -> Request:
    args = {"rid": "r1", "client": "alice", "input_ids": (5, 6, 7), "output_len": 4,
            "arrival_s": 0.0}  # fmt: skip
    return Request(**{**args, **kw})


def test_generate_body_names_the_client_as_routing_key():
    body = generate_body(_req(sampling={"temperature": 0.5, "stop_token_ids": [2]}))
    assert body == {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0.5, "stop_token_ids": [2], "max_new_tokens": 4},
        "stream": True,
        "rid": "r1",
        "routing_key": "alice",
    }
    assert "extra_key" not in body  # it would partition SGLang's prefix cache by client
    lp = generate_body(_req(return_logprob=True, logprob_start_len=1, top_logprobs_num=3))
    assert (lp["return_logprob"], lp["logprob_start_len"], lp["top_logprobs_num"]) == (True, 1, 3)
    assert lp["sampling_params"] == {"max_new_tokens": 4}


def test_generate_body_sends_the_class_as_sglang_priority_when_asked():
    from sgl_fair.request import SLO_PARAM, ServiceClass
    from sgl_fair.worker.sglang.settings import BE_PRIORITY, RT_PRIORITY

    rt = _req(service_class=ServiceClass.RT, extra={"priority": 5})
    assert "priority" not in generate_body(_req())  # only class-aware policies ask for it
    assert generate_body(rt, class_priority=True)["priority"] == RT_PRIORITY  # ours wins
    assert generate_body(_req(), class_priority=True)["priority"] == BE_PRIORITY
    assert RT_PRIORITY - BE_PRIORITY > 10  # SGLang's default preemption threshold
    # An RT request's SLOs ride in custom_params, beside the client's own custom params.
    rt = _req(service_class=ServiceClass.RT, ttft_slo_s=0.3, sampling={"custom_params": {"k": 1}})
    body = generate_body(rt, class_priority=True)
    assert body["sampling_params"]["custom_params"] == {"k": 1, SLO_PARAM: [0.3, 0.2]}
    assert rt.sampling == {"custom_params": {"k": 1}}  # the request's own dict is untouched
    assert "custom_params" not in generate_body(_req(), class_priority=True)["sampling_params"]


def test_sse_parser_takes_events_split_anywhere():
    events = [{"output_ids": list(range(i)), "meta_info": {"x": "a\nb"}} for i in range(5)]
    raw = (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )
    for step in (1, 3, 7, len(raw)):
        parser = SSEParser()
        got = []
        for i in range(0, len(raw), step):
            got += parser.feed(raw[i : i + step])
        assert got[-1] == b"[DONE]" and [json.loads(p) for p in got[:-1]] == events


def _chunk(ids, finish=None, cached=0, **meta):
    return {"output_ids": ids, "meta_info": {"finish_reason": finish, "cached_tokens": cached,
                                             **meta}}  # fmt: skip


def test_stream_state_cumulative_and_incremental():
    cum = StreamState()
    assert cum.feed(_chunk([1])) == [1]
    assert cum.feed(_chunk([1, 2, 3])) == [2, 3]
    assert cum.feed(_chunk([1, 2, 3, 4], {"type": "length", "length": 4}, cached=7)) == [4]
    assert cum.outcome(None).reason is FinishReason.LENGTH and cum.cached_tokens == 7
    inc = StreamState(incremental=True)
    assert inc.feed(_chunk([1])) + inc.feed(_chunk([2, 3])) == [1, 2, 3]
    inc.feed(_chunk([], {"type": "stop", "matched": 2}))
    assert inc.output_ids == [1, 2, 3] and inc.outcome(None).reason is FinishReason.STOP


def test_stream_state_keeps_sglangs_queue_time():
    s = StreamState()
    assert s.queue_s is None  # an SGLang that sends none: the Finished says None
    s.feed(_chunk([1], queue_time=0.25))
    s.feed(_chunk([1, 2], {"type": "length", "length": 2}, queue_time=1.5))
    assert s.queue_s == 1.5
    for bad in (None, "2", True, -1.0):  # ignored, the last good value stays
        s.feed(_chunk([1, 2], queue_time=bad))
        assert s.queue_s == 1.5


def test_stream_state_logprobs_become_finished_fields():
    inp = [[None, 5, None], [-0.5, 6, "x"]]
    outs = [[-0.1, 1, None], [-0.2, 2, None]]
    tops = [[[-0.1, 1, None], [-2.0, 9, None]], None]
    s = StreamState(want_logprobs=True)
    s.feed(_chunk([1], input_token_logprobs=inp, output_token_logprobs=outs[:1],
                  output_top_logprobs=tops[:1]))  # fmt: skip
    s.feed(_chunk([1, 2], {"type": "length"}, input_token_logprobs=inp,
                  output_token_logprobs=outs, output_top_logprobs=tops))  # fmt: skip
    want = {
        "input_logprobs": (None, -0.5),
        "output_logprobs": (-0.1, -0.2),
        "output_top_logprobs": (((-0.1, 1), (-2.0, 9)), ()),
    }
    assert s.finished_logprobs() == want
    inc = StreamState(incremental=True, want_logprobs=True)  # output lists come sliced
    inc.feed(_chunk([1], input_token_logprobs=inp, output_token_logprobs=outs[:1],
                    output_top_logprobs=tops[:1]))  # fmt: skip
    inc.feed(_chunk([2], {"type": "length"}, input_token_logprobs=inp,
                    output_token_logprobs=outs[1:], output_top_logprobs=tops[1:]))  # fmt: skip
    assert inc.finished_logprobs() == want
    assert StreamState().finished_logprobs() == {}


def test_how_a_request_ends():
    s = StreamState()
    s.feed(_chunk([1], {"type": "abort", "message": "refused (retry after 2.5s)",
                        "status_code": 429}))  # fmt: skip
    out = s.outcome(None)
    assert out.reason is FinishReason.REJECTED and out.retry_after_s == 2.5
    assert s.outcome("client disconnected").reason is FinishReason.ABORTED  # we asked for it
    s = StreamState()
    s.feed(_chunk([1], {"type": "abort", "message": "Aborted", "status_code": None}))
    assert s.outcome(None) == status_outcome(None, "Aborted")
    assert s.outcome(None).reason is FinishReason.ABORTED
    s = StreamState()
    s.feed({"error": {"message": "prompt too long", "code": 400}})
    assert s.outcome(None).reason is FinishReason.REJECTED
    assert s.outcome(None).error == "prompt too long"
    assert StreamState().outcome(None).reason is FinishReason.ABORTED  # ended without a finish
    assert status_outcome(429, "busy").retry_after_s == DEFAULT_RETRY_AFTER_S
    assert status_outcome(429, "busy", 7.0).retry_after_s == 7.0
    assert status_outcome(404, "no").reason is FinishReason.REJECTED
    assert status_outcome(503, "down").reason is FinishReason.ABORTED
    assert error_message('{"error": {"message": "m", "code": 400}}') == "m"
    assert error_message('{"error": "plain"}') == "plain"
    assert error_message('{"detail": [{"loc": ["x"]}]}').startswith("[{")
    assert error_message("<html>oops</html>") == "<html>oops</html>"
    assert error_message("", 502) == "HTTP 502"


# ---- a recording proxy -------------------------------------------------------------------------


class RecordingProxy:
    """An HTTP proxy on its own thread: forwards every request to ``target`` (streaming the
    answer back) and records ``(method, path, json body or None)``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[tuple[str, str, object]] = []
        self.loop = asyncio.new_event_loop()
        self.url = ""

    def __enter__(self) -> RecordingProxy:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.http.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            obj = json.loads(body) if body else None
        except ValueError:
            obj = body
        self.seen.append((request.method, request.path_qs, obj))
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with self.http.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for key in ("content-type", "retry-after"):
                if key in up.headers:
                    resp.headers[key] = up.headers[key]
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    def bodies(self, path: str) -> list[object]:
        return [body for _m, p, body in list(self.seen) if p.split("?")[0] == path]


# ---- end to end --------------------------------------------------------------------------------


@contextlib.contextmanager
def standin(tmp_path, *args: str):
    """A stand-in SGLang server (``launch --backend sim --dp 1``) and its KV-event endpoint."""
    sock_dir = tmp_path / f"standin-{free_port()}"
    sock_dir.mkdir()
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(sock_dir)  # the launcher's socket directory lands here
    try:
        cm = launched("--dp", "1", *args, tmp_path=tmp_path)
        live = cm.__enter__()
    finally:
        if old is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old
    try:
        [kv] = glob.glob(str(sock_dir / "sgl-fair-*" / "w0-kv"))
        yield live, f"ipc://{kv}"
    finally:
        cm.__exit__(None, None, None)


@dataclass
class Rig:
    standin: Live
    proxy: RecordingProxy
    outer: Live


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bridge")
    with (
        standin(tmp, "--time-scale", "4", "--kv-tokens", "20000") as (sin, kv),
        RecordingProxy(sin.url) as proxy,
        launched("--worker-url", proxy.url, "--worker-kv-endpoint", kv, tmp_path=tmp) as outer,
    ):
        yield Rig(sin, proxy, outer)


def _sse(lines) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in lines
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _until(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.slow
def test_plain_and_streaming_generate_return_the_servers_tokens(rig):
    body = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 8}}
    before = len(rig.proxy.bodies("/generate"))
    r = httpx.post(rig.outer.url + "/generate", json={**body, "rid": "same-1"}, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    [sent] = rig.proxy.bodies("/generate")[before:]
    assert sent["stream"] is True and sent["input_ids"] == body["input_ids"]
    assert sent["rid"] != "same-1"  # the bridge's own rid per call (SGLang aborts by prefix)
    # The stand-in makes a request's tokens from its rid: asked directly, it says the same.
    direct = httpx.post(rig.standin.url + "/generate", json={**body, "rid": sent["rid"]},
                        timeout=30)  # fmt: skip
    assert out["output_ids"] == direct.json()["output_ids"] and len(out["output_ids"]) == 8

    before = len(rig.proxy.bodies("/generate"))
    with httpx.stream(
        "POST", rig.outer.url + "/generate", json={**body, "rid": "same-2", "stream": True},
        timeout=30,
    ) as resp:  # fmt: skip
        chunks = _sse(list(resp.iter_lines()))
    [sent] = rig.proxy.bodies("/generate")[before:]
    direct = httpx.post(rig.standin.url + "/generate", json={**body, "rid": sent["rid"]},
                        timeout=30)  # fmt: skip
    assert chunks[-1]["output_ids"] == direct.json()["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    ids = [c["output_ids"] for c in chunks]
    assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:], strict=False))  # cumulative


@pytest.mark.slow
def test_server_info_names_the_simulated_engine_only_where_it_serves(rig):
    """Over SGLang servers the router reports no simulated GPU or time scale (it did: the
    simulator's defaults), and the served model as the model; the sim stand-in reports its."""
    outer, sim = rig.outer.info(), rig.standin.info()
    assert (outer["backend"], outer["gpu"], outer["time_scale"]) == ("sglang", None, None)
    assert outer["model"] == outer["served_model_name"]
    assert (sim["backend"], sim["gpu"], sim["time_scale"]) == ("sim", "H100-80GB", 4.0)


@pytest.mark.slow
def test_client_id_travels_as_routing_key_with_the_sampling_params(rig):
    sampling = {
        "max_new_tokens": 6, "min_new_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "frequency_penalty": 0.2, "presence_penalty": 0.1,
        "repetition_penalty": 1.1, "stop_token_ids": [3], "ignore_eos": True,
        "sampling_seed": 7, "stop": ["never-seen"],
    }  # fmt: skip
    r = httpx.post(
        rig.outer.url + "/generate",
        json={"text": "who am I", "rid": "who-1", "sampling_params": sampling},
        headers={"X-Client-Id": "alice"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    [sent] = [
        b for b in rig.proxy.bodies("/generate") if b["sampling_params"].get("sampling_seed") == 7
    ]
    assert sent["routing_key"] == "alice" and "extra_key" not in sent
    want = {k: v for k, v in sampling.items() if k != "stop"}  # stop strings: the router's job
    # and the router's count of alice's calls in flight, for the plugin's share guard
    assert sent["sampling_params"] == {**want, "custom_params": {INFLIGHT_PARAM: 1}}
    metrics = httpx.get(rig.standin.url + "/metrics", timeout=10).text
    assert metric(metrics, "sgl_fair_tenant_requests_total", tenant="alice") >= 1


@pytest.mark.slow
def test_logprobs_come_back_as_the_server_computed_them(rig):
    body = {
        "input_ids": [21, 22, 23, 24, 25], "rid": "lp-1", "return_logprob": True,
        "logprob_start_len": 1, "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 5},
    }  # fmt: skip
    before = len(rig.proxy.bodies("/generate"))
    r = httpx.post(rig.outer.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    [sent] = rig.proxy.bodies("/generate")[before:]  # the stand-in's logprobs follow the rid
    direct = httpx.post(
        rig.standin.url + "/generate", json={**body, "rid": sent["rid"]}, timeout=30
    ).json()
    got, want = r.json()["meta_info"], direct["meta_info"]
    assert len(got["output_token_logprobs"]) == 5
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
        assert got[key] == want[key], key


@pytest.mark.slow
def test_abort_request_and_a_client_disconnect_abort_on_the_server(rig):
    long = {"input_ids": [31, 32], "sampling_params": {"max_new_tokens": 4000}, "stream": True}
    result: dict = {}

    def stream_long() -> None:
        with httpx.stream(
            "POST", rig.outer.url + "/generate", json={**long, "rid": "long-1"}, timeout=60
        ) as resp:
            result["chunks"] = _sse(list(resp.iter_lines()))

    t = threading.Thread(target=stream_long)
    t.start()
    assert _until(lambda: rig.standin.info()["in_flight"] == 1)
    r = httpx.post(rig.outer.url + "/abort_request", json={"rid": "long-1"}, timeout=10)
    assert r.json() == {"aborted": 1}
    t.join(30)
    finish = result["chunks"][-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and 0 < len(result["chunks"][-1]["output_ids"]) < 4000
    long_rids = [b["rid"] for b in rig.proxy.bodies("/generate") if b["input_ids"] == [31, 32]]
    assert {"rid": long_rids[0]} in rig.proxy.bodies("/abort_request")
    assert _until(lambda: rig.standin.info()["in_flight"] == 0)

    async def hang_up() -> None:
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream(
                "POST", rig.outer.url + "/generate", json={**long, "rid": "long-2"}
            ) as resp,
        ):
            async for _line in resp.aiter_lines():
                break  # hang up after the first chunk

    asyncio.run(hang_up())
    long_rids = [b["rid"] for b in rig.proxy.bodies("/generate") if b["input_ids"] == [31, 32]]
    assert _until(lambda: {"rid": long_rids[1]} in rig.proxy.bodies("/abort_request"))
    assert _until(lambda: rig.standin.info()["in_flight"] == 0)
    assert _until(lambda: rig.outer.info()["in_flight"] == 0)
    w = _until(lambda: (x := rig.standin.info()["workers"][0])["kv_used_tokens"] == 0 and x)
    assert w, "the stand-in still holds the aborted requests' KV"


@pytest.mark.slow
def test_kv_events_and_flush_cache_follow_the_server(rig):
    r = httpx.post(
        rig.outer.url + "/generate",
        json={"input_ids": list(range(300, 364)), "sampling_params": {"max_new_tokens": 4}},
        timeout=30,
    )
    assert r.status_code == 200
    w = _until(lambda: (x := rig.outer.info()["workers"][0])["kv_events"] > 0 and x)
    assert w and w["tree_tokens"] > 0 and w["kv_event_gaps"] == 0
    assert w["url"] == rig.proxy.url and w["engine"].startswith("sglang")
    assert w["kv_capacity_tokens"] == 20000  # the server's own capacity, not the sim model's
    r = httpx.post(rig.outer.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert rig.proxy.bodies("/flush_cache")
    # The server's AllBlocksCleared empties the router's tree for that worker.
    assert _until(lambda: rig.outer.info()["workers"][0]["tree_tokens"] == 0)


@pytest.mark.slow
def test_a_refusal_by_the_servers_scheduler_is_429(tmp_path):
    rpm = ("--schedule-policy", "rpm", "--schedule-policy-opt", "limit=1", "--time-scale", "inf")
    with (
        standin(tmp_path, *rpm) as (sin, _kv),
        launched("--worker-url", sin.url, *rpm[:2], tmp_path=tmp_path) as outer,
    ):
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        hdr = {"X-Client-Id": "eager"}
        codes = [
            httpx.post(outer.url + "/generate", json=body, headers=hdr, timeout=30)
            for _ in range(2)
        ]
        assert [r.status_code for r in codes] == [200, 429], [r.text for r in codes]
        assert int(codes[1].headers["Retry-After"]) >= math.ceil(DEFAULT_RETRY_AFTER_S)
        assert outer.info()["in_flight"] == 0


def _start_victim(tmp_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / f"victim-{port}.log", "w")  # noqa: SIM115 - the process keeps it
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--port", str(port), "--time-scale", "4"]
    cmd += ["--sim-eos", "off"]  # the stand-in server runs every request to its length
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        assert proc.poll() is None, (tmp_path / f"victim-{port}.log").read_text()
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("the victim stand-in did not start")


@pytest.mark.slow
def test_a_dead_server_is_routed_around(tmp_path):
    victim, victim_url = _start_victim(tmp_path)
    try:
        with (
            standin(tmp_path, "--time-scale", "4") as (survivor, _kv),
            launched(
                "--worker-url", victim_url, "--worker-url", survivor.url,
                "--health-check-interval", "0.2", "--health-check-timeout", "1",
                tmp_path=tmp_path,
            ) as outer,
        ):  # fmt: skip
            assert [w["alive"] for w in outer.info()["workers"]] == [True, True]
            victim.send_signal(signal.SIGKILL)  # its sim workers follow their parent
            t0 = time.monotonic()
            dead = _until(lambda: not outer.info()["workers"][0]["alive"], timeout_s=10)
            assert dead and time.monotonic() - t0 < 5
            w0 = outer.info()["workers"][0]
            assert "exit" in w0["death"] and w0["url"] == victim_url
            before = metric(
                httpx.get(survivor.url + "/metrics", timeout=10).text,
                "sgl_fair_tenant_requests_total",
            )
            for i in range(4):
                body = {"text": f"after {i}", "sampling_params": {"max_new_tokens": 3}}
                r = httpx.post(outer.url + "/generate", json=body, timeout=30)
                assert r.status_code == 200, r.text
            after = metric(
                httpx.get(survivor.url + "/metrics", timeout=10).text,
                "sgl_fair_tenant_requests_total",
            )
            assert after - before == 4  # all of them went to the live server
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait(10)


@pytest.mark.slow
def test_bros_sends_the_class_as_sglang_priority_end_to_end(tmp_path):
    """``--schedule-policy bros`` over ``--worker-url``: the bridge sends each request's class
    as SGLang's ``priority`` (RT 100, BE 0, in place of the client's own value), and a server
    that maps ``priority >= 100`` to RT (the stand-in with ``--rt-priority-threshold 100``;
    our plugin inside SGLang does the same) serves RT and BE as such."""
    with (
        standin(tmp_path, "--schedule-policy", "bros", "--rt-priority-threshold", "100") as (
            sin,
            kv,
        ),
        RecordingProxy(sin.url) as proxy,
        launched(
            "--worker-url", proxy.url, "--worker-kv-endpoint", kv, "--schedule-policy", "bros",
            tmp_path=tmp_path,
        ) as outer,
    ):  # fmt: skip
        body = {"input_ids": [21, 22, 23], "sampling_params": {"max_new_tokens": 4}}
        rt = {"priority_class": "rt", "ttft_slo_s": 0.3}
        for rid, extra in (("rt-1", rt), ("be-1", {"priority": 500})):
            r = httpx.post(outer.url + "/generate", json={**body, "rid": rid, **extra}, timeout=30)
            assert r.status_code == 200, r.text
        rt_body, be_body = proxy.bodies("/generate")  # in order: rt-1, be-1
        assert (rt_body.get("priority"), be_body.get("priority")) == (100, 0)  # not the 500
        params = [b["sampling_params"].get("custom_params") for b in (rt_body, be_body)]
        slos = [{k: v for k, v in p.items() if k != INFLIGHT_PARAM} for p in params]
        assert slos == [{"sgl_fair_slo_s": [0.3, 0.2]}, {}]
        text = httpx.get(sin.url + "/metrics", timeout=10).text
        name = "sgl_fair_requests_by_class_total"
        assert metric(text, name, priority_class="rt") == 1
        assert metric(text, name, priority_class="be") == 1
