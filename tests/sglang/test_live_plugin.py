"""The plugin inside a real SGLang 0.5.23 server on this CPU (tiny random Llama).

Each test starts ``sglang.launch_server`` with the plugin's environment (as the launcher sets
it) and talks to it over HTTP, SGLang's own API: the plugin loads through the
``sglang.srt.plugins`` entry point in the spawned scheduler process and decides SGLang's real
admission. Nothing here is a stand-in: the batches, results, aborts and retractions the plugin
accounts for are SGLang's.

The flood workload: ``flood`` sends 24 long requests at once, ``victim`` 3 short ones once
half of them wait in SGLang's queue, with ``--max-running-requests 2`` so the queue decides
who runs. SGLang's own policy
serves the flood's backlog first; a fair plugin puts the victim next.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import live_rig
import pytest

from sgl_fair.worker.sglang.settings import PluginSettings

pytestmark = [pytest.mark.sglang_server, pytest.mark.slow]

QUEUE_ARGS = ("--max-running-requests", "2", "--chunked-prefill-size", "512")


def _server(tiny_model, tmp_path, policy: str | None, opts=None, args=QUEUE_ARGS, extra_env=None):
    env = live_rig.server_env(
        extra=(PluginSettings(policy, opts or {}).env() if policy else {}) | (extra_env or {})
    )
    return live_rig.SGLangServer(
        tiny_model, tmp_path / f"sglang-{policy or 'plain'}.log", args=args, env=env
    )


async def _generate(http, url, client, n_out, *, rid=None, priority=None, prompt="Once upon"):
    body = {
        "text": f"{prompt} {client} {rid or ''}",
        "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True, "temperature": 0},
        "routing_key": client,
    }
    if rid is not None:
        body["rid"] = rid
    if priority is not None:
        body["priority"] = priority
    r = await http.post(url + "/generate", json=body, timeout=300)
    return client, time.monotonic(), r


FLOOD = 24  # flood requests, 32 output tokens each; the victim sends 3 of 8


async def _flood_then_victim(url: str, *, victim_priority=None, flood_priority=None):
    """Finish times in order, [(client, t)], for the flood's requests then the victim's (sent
    once the flood is queued in SGLang: a ("sent", t) entry marks when the first victim
    request reached the server), and the retractions SGLang reported for them.

    The times are SGLang's own (``response_sent_to_client_ts``, wall clock, and that less
    ``e2e_latency`` for an arrival), not when this client's loop got to a response: on a busy
    machine the loop may take several finished responses at once, late, and a flood request
    the server finished before the victim arrived would count as finished after it."""
    async with httpx.AsyncClient() as http:
        flood = [
            asyncio.create_task(_generate(http, url, "flood", 32, priority=flood_priority))
            for _ in range(FLOOD)
        ]
        await live_rig.until_queued(http, url, FLOOD // 2)
        victim = [
            asyncio.create_task(_generate(http, url, "victim", 8, priority=victim_priority))
            for _ in range(3)
        ]
        done = await asyncio.gather(*flood, *victim)
    retractions = 0
    finished: list[tuple[str, float]] = []
    arrived: list[float] = []
    for client, _, r in done:
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["completion_tokens"] == (32 if client == "flood" else 8), meta
        retractions += int(meta.get("num_retractions") or 0)
        finished.append((client, float(meta["response_sent_to_client_ts"])))
        if client == "victim":
            arrived.append(finished[-1][1] - float(meta["e2e_latency"]))
    order = sorted([("sent", min(arrived)), *finished], key=lambda x: x[1])
    return order, retractions


def _flood_done_before_victim(order) -> int:
    """How many flood requests finished after the victim's were sent and before its last."""
    sent = next(i for i, (c, _) in enumerate(order) if c == "sent")
    last = max(i for i, (c, _) in enumerate(order) if c == "victim")
    return sum(1 for c, _ in order[sent:last] if c == "flood")


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    """SGLang's own scheduling under the flood (no plugin): the victim waits for the backlog.
    The same plain server then stands for a ``--worker-url`` server started without the
    plugin (test_live_launch)."""
    with _server(tiny_model, tmp_path_factory.mktemp("plain"), None) as server:
        order, _ = asyncio.run(_flood_then_victim(server.url))
        yield server, _flood_done_before_victim(order)


def test_sglang_alone_serves_the_flood_first(baseline):
    _, flood_first = baseline
    assert flood_first >= 10, flood_first  # the workload discriminates


def test_worker_url_refuses_a_server_without_the_plugin(baseline):
    """``--worker-url`` to a plain SGLang server (started without the plugin's variables):
    the launch fails, naming why and how to start the server, never silently unfair."""
    server, _ = baseline
    port = live_rig.free_port()
    cmd = [
        sys.executable, "-m", "sgl_fair.launch", "--port", str(port), "--backend", "sglang",
        "--worker-url", server.url, "--schedule-policy", "vtc",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "runs no sgl-fair plugin" in out and "SGLFAIR_SCHEDULE_POLICY=vtc" in out, out


@pytest.mark.parametrize(
    ("policy", "opts"), [("vtc", {}), ("dlpm", {"quantum": 32})], ids=["vtc", "dlpm"]
)
def test_fair_plugin_decides_sglang_admission(tiny_model, tmp_path, baseline, policy, opts):
    with _server(tiny_model, tmp_path, policy, opts) as server:
        order, _ = asyncio.run(_flood_then_victim(server.url))
        log = server.log_path.read_text(errors="replace")
    flood_first = _flood_done_before_victim(order)
    assert flood_first <= 4, (flood_first, baseline[1])
    assert flood_first < baseline[1]
    assert f"sgl-fair plugin on: local policy {policy}" in log  # in SGLang's own log


def test_rpm_rejects_with_429_inside_sglang(tiny_model, tmp_path):
    """Also: ``SGLFAIR_PROFILE_ADMISSION`` times the scheduler's admission in the server."""
    prof = tmp_path / "admission"
    env = {"SGLFAIR_PROFILE_ADMISSION": str(prof)}
    rpm = {"limit": 3, "window_s": 60}
    with _server(tiny_model, tmp_path, "rpm", rpm, extra_env=env) as server:
        codes = [
            httpx.post(
                server.url + "/generate",
                json={"text": f"hello {i}", "sampling_params": {"max_new_tokens": 2},
                      "routing_key": "alice"},
                timeout=60,
            )
            for i in range(4)
        ]  # fmt: skip
        other = httpx.post(
            server.url + "/generate",
            json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, "routing_key": "bob"},
            timeout=60,
        )
    assert [r.status_code for r in codes[:3]] == [200, 200, 200]
    assert codes[3].status_code == 429, codes[3].text
    assert "rejected by the fair scheduler" in codes[3].text
    assert other.status_code == 200  # the limit is per client
    records = [
        json.loads(line)
        for f in tmp_path.glob("admission.*")
        for line in f.read_text().splitlines()
    ]
    admitted = [r for r in records if r["admitted"] > 0]
    assert len(admitted) >= 4 and all(0 < r["s"] < 10 for r in admitted), records


def test_bros_runs_rt_before_a_be_backlog(tiny_model, tmp_path):
    args = (*QUEUE_ARGS, "--enable-priority-scheduling", "--retraction-policy", "priority")
    with _server(tiny_model, tmp_path, "bros", {"inner": "vtc"}, args=args) as server:
        order, _ = asyncio.run(
            _flood_then_victim(server.url, victim_priority=100, flood_priority=0)
        )
    assert _flood_done_before_victim(order) <= 4


def test_real_retractions_keep_the_accounting(tiny_model, tmp_path):
    """SGLang's own retraction (``SGLANG_TEST_RETRACT``: its scheduler retracts running
    requests every third step): every request still ends with its exact length, SGLang
    reports the retractions, and VTC still puts the victim first — the plugin's ledger took
    SGLang's real ``retract_decode`` results (no second input charge, no lost request)."""
    env = {"SGLANG_TEST_RETRACT": "1"}
    with _server(tiny_model, tmp_path, "vtc", extra_env=env) as server:
        order, retractions = asyncio.run(_flood_then_victim(server.url))
    assert retractions > 0
    assert _flood_done_before_victim(order) <= 4
