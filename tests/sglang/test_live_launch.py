"""``python -m sgl_fair.launch --backend sglang --dp 2`` over two real SGLang servers on this CPU.

The launcher starts the servers itself (tiny random Llama; the CPU flags pass through to
them), the bridges, and the router; the tests talk to it over HTTP as a client would. The
servers' KV events, their real aborts and their real deaths are what the router handles.
The module's last test stops the launcher with SIGTERM and checks every process is gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import live_rig
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # the launcher helpers
from live_helpers import launched  # noqa: E402

pytestmark = [pytest.mark.sglang_server, pytest.mark.slow]

POLICY = "vtc"


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch-sglang")
    mp = pytest.MonkeyPatch()
    for k, v in live_rig.server_env(cores="0|1").items():
        mp.setenv(k, v)
    args = (
        "--backend", "sglang", "--dp", "2", "--model-path", str(tiny_model),
        "--schedule-policy", POLICY, "--heartbeat-timeout", "30",
        *live_rig.CPU_FLAGS, "--max-running-requests", "8",
    )  # fmt: skip
    try:
        with launched(*args, tmp_path=tmp, timeout_s=600) as server:
            yield server
    finally:
        mp.undo()


def _gen(url, text, n_out, **extra):
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True, "temperature": 0},
        **extra,
    }
    return httpx.post(url + "/generate", json=body, timeout=300)


def test_generate_end_to_end_and_kv_events_reach_the_router(live):
    prompt = "Once upon a time there was a tiny model that served many tenants fairly."
    for _ in range(3):
        r = _gen(live.url, prompt, 8)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 8
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        workers = live.info()["workers"]
        if any(w["kv_events"] > 0 and w["tree_tokens"] > 0 for w in workers):
            break
        time.sleep(0.5)
    assert any(w["kv_events"] > 0 and w["tree_tokens"] > 0 for w in workers), workers
    assert all(w["alive"] for w in workers), workers
    assert f"sgl-fair plugin on: local policy {POLICY}" in _server_logs(live)


def _server_logs(live) -> str:
    """The launcher's SGLang servers' own logs (the launcher prints their folder)."""
    marker = "SGLang servers (logs in "
    line = next(x for x in live.log().splitlines() if marker in x)
    folder = Path(line.split(marker, 1)[1].rstrip(")"))
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("server-*.log")))


def test_n_samples_and_a_stop_string(live):
    r = _gen(live.url, "The quick brown fox", 4, sampling_params={"max_new_tokens": 4, "n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2
    full = _gen(live.url, "Hello world! What is", 16, rid="stop-probe-a")
    text = full.json()["text"]
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = httpx.post(
        live.url + "/generate",
        json={
            "text": "Hello world! What is",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": [stop]},
        },
        timeout=120,
    )
    assert cut.status_code == 200, cut.text
    meta = cut.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut.json()["text"]
    assert text.startswith(cut.json()["text"])


def test_streaming_chunks_add_up(live):
    body = {
        "text": "Prefix caching keeps",
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", live.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    assert len(chunks) >= 2
    assert chunks[-1]["meta_info"]["completion_tokens"] == 24
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def _abort_one_of(url: str) -> dict[str, dict]:
    """Three long requests whose rids share a prefix, two tenants; abort ``job1`` only."""
    async with httpx.AsyncClient(timeout=300) as http:

        async def one(rid, client):
            body = {
                "text": f"Fairness means {rid}",
                "rid": rid,
                "sampling_params": {"max_new_tokens": 96, "ignore_eos": True},
            }
            r = await http.post(url + "/generate", json=body, headers={"X-Client-Id": client})
            return rid, r.json()

        tasks = [
            asyncio.create_task(one("job1", "alice")),
            asyncio.create_task(one("job1-1", "alice")),
            asyncio.create_task(one("job10", "bob")),
        ]
        await asyncio.sleep(1.5)
        r = await http.post(url + "/abort_request", json={"rid": "job1"})
        assert r.status_code == 200, r.text
        return dict(await asyncio.gather(*tasks))


def test_abort_is_exact_across_tenants(live):
    got = asyncio.run(_abort_one_of(live.url))
    reasons = {rid: body["meta_info"]["finish_reason"]["type"] for rid, body in got.items()}
    assert reasons["job1"] == "abort", got["job1"]
    assert reasons["job1-1"] == "length", got["job1-1"]
    assert reasons["job10"] == "length", got["job10"]  # another tenant's request lives
    assert got["job10"]["meta_info"]["completion_tokens"] == 96


def test_client_disconnect_frees_the_request_on_sglang(live):
    urls = [w["url"] for w in live.info()["workers"]]
    body = {
        "text": "A long story that the client stops reading",
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", live.url + "/generate", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = sum(_running(u) for u in urls)
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0  # SGLang itself no longer runs it: its KV is free


def _running(url: str) -> int:
    loads = httpx.get(url + "/v1/loads?include=core", timeout=10).json()["loads"]
    return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)


def test_a_killed_sglang_server_is_routed_around(live):
    """kill -9 one SGLang server (its whole process group) under load: every non-streaming
    request still finishes, on the other server; new ones go there."""
    workers = live.info()["workers"]
    victim = workers[0]

    async def load():
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = [
                http.post(
                    live.url + "/generate",
                    json={"text": f"request {i}", "sampling_params": {"max_new_tokens": 32,
                          "ignore_eos": True}},
                )
                for i in range(8)
            ]  # fmt: skip
            running = asyncio.gather(*tasks)
            await asyncio.sleep(0.8)
            _kill_server(victim["url"])
            return await running

    results = asyncio.run(load())
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
    assert all(r.json()["meta_info"]["completion_tokens"] == 32 for r in results)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = {w["id"]: w["alive"] for w in live.info()["workers"]}
        if not states[victim["id"]]:
            break
        time.sleep(0.5)
    assert not states[victim["id"]], states
    assert _gen(live.url, "after the death", 4).status_code == 200


def _kill_server(url: str) -> None:
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN" and conn.pid:
            os.killpg(os.getpgid(conn.pid), signal.SIGKILL)
            return
    raise AssertionError(f"no process listens on {url}")


def test_sigterm_stops_the_launcher_and_every_server(live):
    import psutil

    children = psutil.Process(live.proc.pid).children(recursive=True)
    assert children
    live.proc.send_signal(signal.SIGTERM)
    assert live.proc.wait(60) == 0, live.log()[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline()[:4] for p in alive]
