"""End to end on loopback: ``python -m sgl_fair.launch --dp 2`` and real HTTP clients.

The server runs the simulated engine in wall-clock time; every request goes HTTP -> router
-> zmq -> worker process -> zmq -> HTTP. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from live_helpers import launched

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    with launched("--dp", "2", "--time-scale", "4", "--kv-tokens", "20000", tmp_path=tmp) as live:
        yield live


def _sse(lines):
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def test_generate_plain_and_streaming(server):
    r = httpx.post(
        server.url + "/generate",
        json={"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 12}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 12 == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert body["text"] and meta["prompt_tokens"] > 0

    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={
            "text": "The quick brown fox",
            "sampling_params": {"max_new_tokens": 12},
            "stream": True,
        },
        timeout=30,
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = list(resp.iter_lines())
    chunks = _sse(lines)
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert len(chunks[-1]["output_ids"]) == 12
    # The second identical prompt hits the prefix cache of whichever worker served it.
    assert chunks[-1]["meta_info"]["cached_tokens"] > 0
    assert chunks[-1]["meta_info"]["queue_time"] >= 0  # SGLang's field: seconds waiting


def test_same_rid_gives_same_text_and_stop_strings_cut_it(server):
    first = httpx.post(
        server.url + "/generate",
        json={"text": "Tell me", "rid": "fixed-rid-1", "sampling_params": {"max_new_tokens": 10}},
        timeout=30,
    ).json()
    words = first["text"].split()
    stop = words[3]
    second = httpx.post(
        server.url + "/generate",
        json={
            "text": "Tell me",
            "rid": "fixed-rid-1",
            "sampling_params": {"max_new_tokens": 10, "stop": [stop]},
        },
        timeout=30,
    ).json()
    assert second["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert second["text"] == first["text"][: first["text"].index(stop)]


def test_openai_client_completions_and_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    models = client.models.list()
    name = models.data[0].id
    comp = client.completions.create(model=name, prompt="Once upon a time", max_tokens=7)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 7
    assert comp.choices[0].text

    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and text
    assert chunks[-1].usage.completion_tokens == 6

    stream = client.completions.create(model=name, prompt="abc", max_tokens=5, stream=True)
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts) and parts[-1].choices[0].finish_reason


def test_select_style_logprob_requests(server):
    """What sglang's RuntimeEndpoint.select sends, and the computation it does on the reply."""
    prefix = "Question: is the sky blue? Answer:"
    pre = httpx.post(
        server.url + "/generate",
        json={"text": prefix, "sampling_params": {"max_new_tokens": 0}},
        timeout=30,
    ).json()
    prompt_len = pre["meta_info"]["prompt_tokens"]
    assert pre["meta_info"]["completion_tokens"] == 0 and pre["text"] == ""
    choices = [" yes", " no", " maybe"]
    r = httpx.post(
        server.url + "/generate",
        json={
            "text": [prefix + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": max(prompt_len - 2, 0),
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    objs = r.json()
    assert isinstance(objs, list) and len(objs) == 3
    normalized = []
    for obj, choice in zip(objs, choices, strict=True):
        lps = obj["meta_info"]["input_token_logprobs"]
        assert lps and all(len(e) == 3 and isinstance(e[2], str) for e in lps)
        assert obj["meta_info"]["prompt_tokens"] - max(prompt_len - 2, 0) == len(lps)
        values = [x[0] for x in lps if x[0]]
        normalized.append(sum(values) / len(values))
        healed = lps[0][-1]
        assert isinstance(prefix.endswith(healed), bool)
        assert "".join(e[2] for e in lps).endswith(choice)
    assert len(set(normalized)) == 3  # the choices score differently, deterministically


def test_metrics_and_info(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert "sgl_fair_tenant_requests_total" in text and "sgl_fair_worker_kv_usage" in text
    info = server.info()
    assert info["dp_size"] == 2 and all(w["alive"] for w in info["workers"])
    mi = httpx.get(server.url + "/get_model_info", timeout=10).json()
    assert mi["model_path"] and mi["is_generation"] is True
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200


M = "Llama-3.1-8B"  # the served model name (the sim model)
BAD = [
    # (path, body bytes or json, headers, status, param)
    ("/generate", b"{not json", {}, 400, None),
    ("/generate", b"[1, 2]", {}, 400, None),
    ("/generate", {"sampling_params": {"max_new_tokens": 4}}, {}, 400, "text"),
    ("/generate", {"text": ""}, {}, 400, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, {}, 400, "input_ids"),
    ("/generate", {"text": 5}, {}, 400, "text"),
    ("/generate", {"input_ids": []}, {}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, -2]}, {}, 400, "input_ids[1]"),
    ("/generate", {"input_ids": [1, 10**9]}, {}, 400, "input_ids[1]"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, {}, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}, {}, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, {}, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, {}, 400,
     "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, {}, 400,
     "sampling_params.bogus"),
    ("/generate", {"text": "hi", "stream": "yes"}, {}, 400, "stream"),
    ("/generate", {"text": "hi", "lora_path": "x"}, {}, 400, "lora_path"),  # sim: no LoRA
    ("/generate", {"text": "word " * 30000}, {}, 400, "text"),  # longer than the context
    ("/v1/completions", {"model": 3, "prompt": "hi"}, {}, 400, "model"),
    ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": -5}, {}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": M, "messages": []}, {}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user"}]}, {}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "robot", "content": "x"}]}, {},
     400, "messages[0].role"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "x"}], "n": 0},
     {}, 400, "n"),
    ("/generate", {"text": "hi"}, {"X-Client-Id": "has space"}, 400, None),
]  # fmt: skip


def test_bad_input_table_then_still_serving(server):
    bad = []
    for path, body, headers, status, param in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(
            server.url + path,
            content=data,
            headers={"content-type": "application/json", **headers},
            timeout=30,
        )
        err = r.json()["error"]
        if r.status_code != status or (param is not None and err["param"] != param):
            bad.append((path, body if len(str(body)) < 200 else "...", r.status_code, err))
        assert err["code"] == r.status_code and err["message"], (path, body, err)
        assert err["type"].endswith("_error")
    assert not bad, "\n".join(map(str, bad))
    assert httpx.get(server.url + "/nowhere", timeout=10).status_code == 404
    assert httpx.get(server.url + "/generate", timeout=10).status_code == 405
    big = b'{"text": "' + b"a" * (17 << 20) + b'"}'
    assert httpx.post(server.url + "/generate", content=big, timeout=60).status_code == 413
    # Still serving, and nothing leaked: no request is left in flight anywhere.
    ok = httpx.post(server.url + "/generate", json={"text": "still here"}, timeout=30)
    assert ok.status_code == 200
    info = server.info()
    assert info["in_flight"] == 0 and all(w["queue_len"] == 0 for w in info["workers"])


def test_client_disconnect_aborts_and_frees_kv(server):
    async def go():
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream(
                "POST",
                server.url + "/generate",
                json={
                    "text": "long one",
                    "sampling_params": {"max_new_tokens": 4000},
                    "stream": True,
                },
            ) as resp,
        ):
            async for _line in resp.aiter_lines():
                break  # hang up after the first chunk

    asyncio.run(go())
    for _ in range(50):
        info = server.info()
        # Load reports come every 0.1 s; wait for one taken after the abort.
        if info["in_flight"] == 0 and all(w["kv_used_tokens"] == 0 for w in info["workers"]):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert info["in_flight"] == 0, info
    assert all(w["kv_used_tokens"] == 0 for w in info["workers"]), [
        {k: w[k] for k in ("queue_len", "num_waiting", "num_running", "kv_used_tokens")}
        for w in info["workers"]
    ]


def test_loadtest_harness_against_the_live_server(server, tmp_path):
    """``sgl_fair.loadtest`` end to end against the real server: programs run closed loop,
    the row and the files come out, and nothing fails."""
    from sgl_fair.loadtest import LoadTestConfig, run_loadtest

    cfg = LoadTestConfig(
        url=server.url,
        workload="judge",
        scenario="s1",
        clients=2,
        duration_s=3.0,
        rate=0.5,
        out=tmp_path / "lt",
        stream_interval=4,
    )
    res = run_loadtest(cfg)
    row, totals = res["row"], res["totals"]
    assert totals["calls_ok"] > 0 and totals["calls_failed"] == 0, res["errors"]
    assert row["dp"] == 2 and row["policy"] == "D2LPM"
    assert row["num_calls"] == totals["calls_ok"]
    assert (tmp_path / "lt" / "results.json").exists()
    assert (tmp_path / "lt" / "requests.jsonl").read_text().count("\n") == row["num_calls"]
    # Judge calls share their article: the workers' caches served part of the prompts.
    assert row["cache_hit_rate"] > 0


def test_abort_request_by_rid(server):
    import threading

    out = {}

    def long_call():
        out["r"] = httpx.post(
            server.url + "/generate",
            json={
                "text": "abort me",
                "rid": "to-abort-1",
                "sampling_params": {"max_new_tokens": 5000},
            },
            timeout=60,
        )

    t = threading.Thread(target=long_call)
    t.start()
    for _ in range(50):
        if server.info()["in_flight"]:
            break
        asyncio.run(asyncio.sleep(0.05))
    r = httpx.post(server.url + "/abort_request", json={"rid": "to-abort-1"}, timeout=10)
    assert r.status_code == 200 and r.json()["aborted"] == 1
    t.join(30)
    body = out["r"].json()
    assert body["meta_info"]["finish_reason"]["type"] == "abort", body
    assert len(body["output_ids"]) < 5000
    bad = httpx.post(server.url + "/abort_request", json={"rid": 5}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
