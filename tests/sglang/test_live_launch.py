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
import subprocess
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
KEY = "sk-worker-test"  # --worker-api-key: the servers get --api-key, the bridges send it
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch-sglang")
    mp = pytest.MonkeyPatch()
    for k, v in live_rig.server_env(cores="0|1").items():
        mp.setenv(k, v)
    args = (
        "--backend", "sglang", "--dp", "2", "--model-path", str(tiny_model),
        "--schedule-policy", POLICY, "--heartbeat-timeout", "30", "--worker-api-key", KEY,
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
    """Three requests whose rids share a prefix, two tenants; ``job1`` (streamed, long) is
    aborted once its first tokens arrive, while the other two run."""
    async with httpx.AsyncClient(timeout=300) as http:

        async def one(rid, client, n_out):
            body = {
                "text": f"Fairness means {rid}",
                "rid": rid,
                "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True},
            }
            r = await http.post(url + "/generate", json=body, headers={"X-Client-Id": client})
            return rid, r.json()

        others = [
            asyncio.create_task(one("job1-1", "alice", 200)),
            asyncio.create_task(one("job10", "bob", 200)),
        ]
        body = {
            "text": "Fairness means job1",
            "rid": "job1",
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        }
        last, aborted = None, False
        async with http.stream("POST", url + "/generate", json=body) as stream:
            async for line in stream.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                last = json.loads(line[5:])
                if last["meta_info"]["completion_tokens"] >= 1 and not aborted:
                    aborted = True
                    r = await http.post(url + "/abort_request", json={"rid": "job1"})
                    assert r.status_code == 200, r.text
        return {"job1": last, **dict(await asyncio.gather(*others))}


def test_abort_is_exact_across_tenants(live):
    got = asyncio.run(_abort_one_of(live.url))
    reasons = {rid: body["meta_info"]["finish_reason"]["type"] for rid, body in got.items()}
    assert reasons["job1"] == "abort", got["job1"]
    assert reasons["job1-1"] == "length", got["job1-1"]
    assert reasons["job10"] == "length", got["job10"]  # another tenant's request lives
    assert got["job10"]["meta_info"]["completion_tokens"] == 200
    assert got["job1"]["meta_info"]["completion_tokens"] < 3000


def test_client_disconnect_frees_the_request_on_sglang(live):
    urls = [w["url"] for w in live.info()["workers"]]
    body = {  # ~4,000 tokens: it would run ~20 s on this CPU by itself (the model's 4,096)
        "text": "A long story that the client stops reading",
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", live.url + "/generate", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                assert sum(_running(u) for u in urls) >= 1  # SGLang runs it now
                break
    # Gone within 8 s of the disconnect, far sooner than it ends by itself: only an abort
    # the router sent through its bridge does that (before, the test waited 20 s for a
    # request that finished by itself in ~15 s, and passed with no abort sent).
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        running = sum(_running(u) for u in urls)
        if running == 0:
            break
        time.sleep(0.25)
    assert running == 0  # SGLang itself no longer runs it: its KV is free


def _running(url: str) -> int:
    loads = httpx.get(url + "/v1/loads?include=core", headers=AUTH, timeout=10).json()["loads"]
    return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)


def test_the_servers_report_the_plugin_and_keep_sglangs_defaults(live):
    """Each server the launcher started: its /server_info names our plugin and policy,
    streams incrementally, keeps SGLang's own batch defaults (none given here but
    --max-running-requests), and wants the worker key."""
    for w in live.info()["workers"]:
        assert httpx.get(w["url"] + "/server_info", timeout=10).status_code == 401
        info = httpx.get(w["url"] + "/server_info", headers=AUTH, timeout=10).json()
        assert info["sgl_fair"]["policy"] == POLICY, info.get("sgl_fair")
        assert info["incremental_streaming_output"] is True
        assert info["chunked_prefill_size"] != 8192  # SGLang's CPU default, not ours
        assert info["max_running_requests"] == 8


def test_worker_url_checks_the_plugin_on_the_server(live, tmp_path):
    """A second router over one of these servers (--worker-url): the same policy is served,
    another is refused at start with the reason, and so is a router without the key."""
    url = live.info()["workers"][1]["url"]
    base = ("--backend", "sglang", "--worker-url", url, "--heartbeat-timeout", "30")
    with launched(
        *base, "--schedule-policy", POLICY, "--worker-api-key", KEY, tmp_path=tmp_path
    ) as other:
        assert f"(sgl-fair {POLICY})" in other.log()
        r = _gen(other.url, "through a second router", 4)
        assert r.status_code == 200, r.text
    for extra, reason in (
        (("--schedule-policy", "dlpm", "--worker-api-key", KEY), "not 'dlpm'"),
        (("--schedule-policy", POLICY), "--worker-api-key"),
    ):
        out = _launch_fails(*base, *extra)
        assert reason in out, out


def test_post_workers_adds_a_running_sglang_server_and_delete_drains_it(live, tmp_path):
    """A router over server 0 only (``--worker-url``) takes server 1 at run time with
    ``POST /workers {"url"}`` (its plugin checked, as at start), routes to both, refuses the
    same server twice, a server that does not answer, a public KV endpoint and a tcp
    endpoint (its workers are servers), each naming the field; ``DELETE`` drains it and the
    server itself keeps running."""
    url0, url1 = (w["url"] for w in live.info()["workers"])
    base = ("--backend", "sglang", "--worker-url", url0, "--heartbeat-timeout", "30",
            "--schedule-policy", POLICY, "--worker-api-key", KEY)  # fmt: skip
    with launched(*base, tmp_path=tmp_path) as other:
        r = httpx.post(other.url + "/workers", json={"url": url1 + "/"}, timeout=60)
        assert r.status_code == 201, r.text
        wid = r.json()["id"]
        assert wid == 1 and r.json()["state"] == "starting"
        deadline = time.monotonic() + 60
        while not (w := other.info()["workers"][wid])["alive"]:
            assert time.monotonic() < deadline, w
            time.sleep(0.2)
        assert w["url"] == url1 and f"(sgl-fair {POLICY})" in w["engine"]

        async def load() -> list[int]:  # at once, different prompts: both servers take some
            async with httpx.AsyncClient(timeout=300) as http:
                rs = await asyncio.gather(*(
                    http.post(other.url + "/generate", json={
                        "text": f"{i} to both servers " * 4,
                        "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                    })
                    for i in range(16)
                ))  # fmt: skip
            return [r.status_code for r in rs]

        assert asyncio.run(load()) == [200] * 16
        assert all(w["dispatched"] > 0 for w in other.info()["workers"]), other.info()["workers"]
        refused = [
            ({"url": url1}, 409, "url"),
            ({"url": "http://127.0.0.1:9"}, 400, "url"),
            ({"url": "http://127.0.0.1:9", "kv_endpoint": "tcp://8.8.8.8:5557"}, 400,
             "kv_endpoint"),
            ({"endpoint": "tcp://127.0.0.1:9"}, 400, "endpoint"),
            ({}, 400, "endpoint"),
        ]  # fmt: skip
        for body, status, field in refused:
            r = httpx.post(other.url + "/workers", json=body, timeout=60)
            assert r.status_code == status and r.json()["error"]["param"] == field, (body, r.text)
        r = httpx.delete(f"{other.url}/workers/{wid}", timeout=30)
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 30
        while len(other.info()["workers"]) > 1:
            assert time.monotonic() < deadline, other.info()["workers"]
            time.sleep(0.2)
        assert _gen(other.url, "after the removal", 2).status_code == 200
    assert httpx.get(url1 + "/health", headers=AUTH, timeout=10).status_code == 200


def test_a_router_finds_sglang_servers_as_kubernetes_pods(live, tmp_path):
    """``--backend sglang --worker-discovery-k8s``: the ready pods of the selector (a fake API
    server) are the router's servers, each checked and bridged as ``POST /workers`` does; a
    terminating pod's server is drained and removed."""
    from kube_helpers import SELECTOR, TOKEN, FakeKube, pod

    url1 = live.info()["workers"][1]["url"]
    port1 = int(url1.rsplit(":", 1)[1])
    kube = FakeKube()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    kube.pods = [pod("sglang-1", port1, port_name="http", kv=False)]
    args = (
        "--backend", "sglang", "--worker-discovery-k8s", SELECTOR, "--k8s-api", kube.url,
        "--k8s-namespace", "test", "--k8s-token-file", str(token), "--k8s-period-s", "0.2",
        "--heartbeat-timeout", "30", "--schedule-policy", POLICY, "--worker-api-key", KEY,
    )  # fmt: skip
    try:
        with launched(*args, tmp_path=tmp_path) as other:
            deadline = time.monotonic() + 60
            while not [w for w in other.info()["workers"] if w["alive"]]:
                assert time.monotonic() < deadline, other.log()[-3000:]
                time.sleep(0.2)
            (w,) = other.info()["workers"]
            assert w["url"] == url1 and f"(sgl-fair {POLICY})" in w["engine"]
            assert _gen(other.url, "through a discovered server", 4).status_code == 200
            kube.pods = [pod("sglang-1", port1, port_name="http", kv=False, deleting=True)]
            deadline = time.monotonic() + 30
            while other.info()["workers"]:
                assert time.monotonic() < deadline, other.info()["workers"]
                time.sleep(0.2)
    finally:
        kube.close()
    assert httpx.get(url1 + "/health", headers=AUTH, timeout=10).status_code == 200


def _launch_fails(*args: str) -> str:
    port = live_rig.free_port()
    cmd = [sys.executable, "-m", "sgl_fair.launch", "--port", str(port), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_killed_sglang_server_is_routed_around(live):
    """kill -9 one SGLang server (its whole process group) under load, with two CPU spinners
    beside it (a loaded machine reorders what the router hears: the calls' transport errors
    before the worker's death): every non-streaming request still finishes, on the other
    server; new ones go there."""
    workers = live.info()["workers"]
    victim = workers[0]
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(2)]
    try:
        _kill_under_load(live, victim)
    finally:
        for p in spinners:
            p.kill()
            p.wait(10)


def _kill_under_load(live, victim) -> None:

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
