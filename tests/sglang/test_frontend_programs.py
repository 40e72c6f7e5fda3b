"""SGLang frontend programs (``@sgl.function`` ToT and judge) against the live sim server.

``python -m sgl_fair.launch --backend sim --dp 2`` on loopback, driven by SGLang 0.5.23's own
interpreter through ``ClientEndpoint`` (a ``RuntimeEndpoint``): the programs' structure is
checked from both sides (the endpoint's records and the server's per-tenant Prometheus
counters), identity from the server's tenant labels and, on a wire-capturing fake, from the
requests themselves; then the load-test driver, and failures (no server, a silent server, a
refused key) that must end as clear errors rather than hangs.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

sgl = pytest.importorskip("sglang")

from sgl_fair.loadtest import FRONTEND  # noqa: E402
from sgl_fair.loadtest import main as loadtest_main  # noqa: E402
from sgl_fair.workloads.harness import HarnessConfig, build_clients  # noqa: E402
from sgl_fair.workloads.harness_report import fairness_table  # noqa: E402
from sgl_fair.workloads.programs.sgl_driver import (  # noqa: E402
    FrontendDriver,
    frontend_programs,
    frontend_runs,
)
from sgl_fair.workloads.programs.sgl_endpoint import (  # noqa: E402
    CallLog,
    ClientEndpoint,
    EndpointUnreachable,
    requests_by_kind,
)
from sgl_fair.workloads.programs.sgl_frontend import (  # noqa: E402
    VERDICTS,
    JudgeProgram,
    ProgramFailed,
    ToTProgram,
    question_for,
    run_program,
    run_programs,
)
from sgl_fair.workloads.programs.sgl_frontend import main as frontend_main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # the launcher helpers
from live_helpers import free_port, launched  # noqa: E402

# SGLang prints the traceback of every failed call; the failure tests make some on purpose.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Error in stream_executor")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frontend")
    with launched("--backend", "sim", "--dp", "2", "--time-scale", "inf", tmp_path=tmp) as live:
        yield live


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frontend-keys")
    tenants = tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\napi_keys = ["sk-acme"]\n')
    args = ("--backend", "sim", "--dp", "1", "--time-scale", "inf", "--tenants", str(tenants))
    with launched(*args, tmp_path=tmp) as live:
        yield live


def tenant_requests(url: str) -> Counter[tuple[str, str]]:
    """``sgl_fair_tenant_requests_total`` by (tenant, outcome)."""
    out: Counter[tuple[str, str]] = Counter()
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"sgl_fair_tenant_requests_total\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels["tenant"], labels["outcome"]] += int(float(m.group(2)))
    return out


COMPLETED = ("ok",)


def wait_for_count(url: str, tenant: str, want: int, *, outcomes=COMPLETED) -> int:
    """The server counts a request when it finishes; give the last one a moment. A call
    that ended on its stop string (the programs' ``stop="\n"``) counts "ok" whether the
    router matched the string or the worker ended first."""
    deadline = time.monotonic() + 5
    while True:
        counts = tenant_requests(url)
        got = sum(counts[tenant, o] for o in outcomes)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# The programs, end to end


def test_tot_forks_a_tree_and_selects_through_runtime_endpoint(server):
    log = CallLog()
    endpoint = ClientEndpoint(server.url, "fe-tot", log=log, timeout_s=30)
    program = ToTProgram(branches=2, depth=2, max_tokens=8)
    result = run_program(program, endpoint.for_program("tot-0", app="tot"), seed=3)
    calls = log.close()

    assert calls and all(c.state == "ok" and c.client == "fe-tot" for c in calls)
    assert (
        requests_by_kind(calls) == program.calls()
    )  # 7 gens, 3 forks, 5 selects (2 requests each)
    # The tree: 4 leaves, each a line of 2 thoughts; siblings share their parent's thought
    # and differ from each other (their prompts differ), every thought is text.
    assert result.question == question_for(3).text
    lines = result.lines
    assert len(lines) == 4 and all(len(line) == 2 and all(line) for line in lines)
    assert lines[0][0] == lines[1][0] != lines[2][0] == lines[3][0]
    assert len({line[1] for line in lines}) == 4
    assert set(result.verdicts) <= {"yes", "no"}
    yes = [k for k, v in enumerate(result.verdicts) if v == "yes"]
    assert result.shortlist == (yes or [0, 1, 2, 3]) and result.best in result.shortlist
    assert result.answer
    # What each kind of call was: generations stream their tokens; a select's choices are
    # prefill-only items with the prefix cached by its first request.
    gens = [c for c in calls if c.node.endswith("-gen")]
    assert len(gens) == 7 and all(1 <= c.completion_tokens <= 8 for c in gens)
    assert all(c.send_s <= c.first_token_s <= c.finish_s for c in gens)
    choices = [c for c in calls if "-select.choices" in c.node]
    assert len(choices) == 4 * 2 + len(result.shortlist)
    assert all(c.max_new_tokens == 0 == c.completion_tokens for c in choices)
    assert all(c.prompt_tokens > c.cached_tokens > 0 for c in choices)
    # The server saw every one of them, under this client's name.
    assert wait_for_count(server.url, "fe-tot", len(calls)) == len(calls)


def test_select_scores_choices_with_the_servers_logprobs(server):
    @sgl.function
    def pick(s, question):
        s += "Question: " + question + "\nAnswer: " + sgl.select("v", choices=VERDICTS)

    endpoint = ClientEndpoint(server.url, "fe-select", timeout_s=30)
    state = pick.run(question=question_for(0).text, backend=endpoint, temperature=0)
    meta = state.get_meta_info("v")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == len(VERDICTS) and len(set(scores)) == len(VERDICTS)
    assert state["v"] == VERDICTS[scores.index(max(scores))]  # token_length_normalized
    assert all(lps and all(len(e) == 3 for e in lps) for lps in meta["input_token_logprobs"])


def test_judge_generates_critiques_and_verdicts_via_run_batch(server):
    log = CallLog()
    endpoint = ClientEndpoint(server.url, "fe-judge", log=log, timeout_s=30)
    program = JudgeProgram(num_candidates=3, max_tokens=8)
    results = run_programs(program, endpoint, [0, 1], num_threads=2)
    calls = log.close()

    assert all(c.state == "ok" for c in calls)
    want = program.calls() + program.calls() + Counter({"cache": 1})  # run_batch's precache
    assert requests_by_kind(calls) == want
    for seed, r in zip([0, 1], results, strict=True):
        assert r.question == question_for(seed).text
        assert len(r.answers) == 3 == len(set(r.answers)) and all(r.answers)
        assert len(set(r.critiques)) == 3 and all(r.critiques)
        assert set(r.verdicts) <= set(VERDICTS) and 0 <= r.best < 3
    assert wait_for_count(server.url, "fe-judge", len(calls)) == len(calls)

    given = JudgeProgram(num_candidates=3, max_tokens=8, given_answers=True)
    r = run_program(given, ClientEndpoint(server.url, "fe-judge", timeout_s=30), seed=2)
    assert r.answers == list(question_for(2).candidates)


def test_cli_prints_a_line_per_run(server, capsys):
    argv = ["--url", server.url, "--program", "judge", "--client", "fe-cli", "--num", "2"]
    assert frontend_main([*argv, "--max-tokens", "6", "--given-answers"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("judge seed 0: 3 candidates") and out[1].startswith("judge seed 1")
    assert out[2].startswith("client fe-cli: ") and "0 failed" in out[2]


# ---------------------------------------------------------------------------------------------
# Identity


class _Capture(BaseHTTPRequestHandler):
    """A minimal SGLang: logs every request; char tokens; select-shaped logprobs."""

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"model_path": "fake-model"}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.log.append((dict(self.headers), body))
        if self.server.stall:  # silence, then hang up (or at release)
            self.server.release.wait(self.server.stall)
            return
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        max_new = body["sampling_params"].get("max_new_tokens", 128)
        start = max(body.get("logprob_start_len", 0), 0)
        objs = []
        for i, text in enumerate(texts):
            out = " ok" if max_new else ""
            lps = [[-0.1 * (1 + (j + i) % 7), ord(ch), ch] for j, ch in enumerate(text[start:])]
            meta = {
                "prompt_tokens": len(text), "completion_tokens": len(out), "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": len(out)},
                "input_token_logprobs": lps, "output_token_logprobs": [],
            }  # fmt: skip
            objs.append({"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta})
        if body.get("stream"):
            sse = f"data: {json.dumps(objs[0])}\n\ndata: [DONE]\n\n"
            self._send(sse.encode(), "text/event-stream")
        else:
            self._send(json.dumps(objs if isinstance(body["text"], list) else objs[0]).encode())


@pytest.fixture
def capture():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    httpd.daemon_threads = True
    httpd.log, httpd.stall, httpd.release = [], 0.0, threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


def test_every_call_carries_the_clients_identity(capture):
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    log = CallLog(run_tag="t1")
    endpoint = ClientEndpoint(url, "alice", api_key="sk-alice", log=log, timeout_s=10)
    run_program(JudgeProgram(num_candidates=2, max_tokens=4), endpoint, seed=0)
    calls = log.close()

    assert len(capture.log) == requests_by_kind(calls).total() > 10
    wire_rids = []
    for headers, body in capture.log:
        assert headers["X-Client-Id"] == "alice"
        assert headers["Authorization"] == "Bearer sk-alice"
        assert body["routing_key"] == "alice"
        wire_rids += body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
    assert sorted(wire_rids) == sorted(c.wire_rid for c in calls)  # one per item, unique
    assert len(set(wire_rids)) == len(wire_rids) and all(r.startswith("t1-") for r in wire_rids)


def test_api_key_names_the_tenant_and_a_missing_key_fails_clearly(keyed):
    log = CallLog()
    endpoint = ClientEndpoint(keyed.url, "mallory", api_key="sk-acme", log=log, timeout_s=30)
    run_program(JudgeProgram(num_candidates=2, max_tokens=4, given_answers=True), endpoint, 0)
    calls = log.close()
    assert wait_for_count(keyed.url, "acme", len(calls)) == len(calls)
    assert not any(t == "mallory" for t, _ in tenant_requests(keyed.url))

    log = CallLog()
    endpoint = ClientEndpoint(keyed.url, "mallory", log=log, timeout_s=30)
    with pytest.raises(ProgramFailed, match="HTTP 401.*missing API key"):
        run_program(ToTProgram(branches=2, depth=1, max_tokens=4), endpoint, seed=0)
    failed = [c for c in log.close() if c.state == "failed"]
    assert failed and all(c.status == 401 and "401" in c.error for c in failed)


# ---------------------------------------------------------------------------------------------
# The load-test driver


def test_loadtest_drives_frontend_programs_for_two_clients(server, tmp_path, capsys):
    argv = ["--driver", FRONTEND, "--url", server.url, "--workload", "judge", "--scenario",
            "none", "--clients", "lt-alice,lt-bob", "--duration", "2", "--rate", "3",
            "--param", "max_tokens=6", "--param", "num_candidates=2", "--no-progress",
            "--out", str(tmp_path), "--seed", "1"]  # fmt: skip
    assert loadtest_main(argv) == 0
    assert "lt-alice" in capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    table = {r["client"]: r for r in results["fairness"]}
    assert set(table) == {"lt-alice", "lt-bob"}
    for r in table.values():
        assert r["programs_done"] == r["programs_started"] >= 1
        assert r["calls_ok"] > 0 and r["calls_failed"] == 0 and r["service"] > 0
    assert results["errors"] == {} and results["totals"]["calls_failed"] == 0
    assert results["run"]["driver"] == FRONTEND
    records = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert all(r["state"] == "ok" and r["app"] == "judge" for r in records)
    per_run = JudgeProgram(num_candidates=2).calls()
    for client, r in table.items():
        mine = [c for c in records if c["client"] == client]
        assert len(mine) == r["calls_ok"]
        assert wait_for_count(server.url, client, len(mine)) == len(mine)
        runs = {c["program_id"] for c in mine}
        assert requests_by_kind(_Rec(c) for c in mine) == Counter(
            {k: n * len(runs) for k, n in per_run.items()}
        )
    assert "sglang-frontend" in (tmp_path / "report.md").read_text()


class _Rec:
    def __init__(self, d):
        self.program_id, self.node = d["program_id"], d["node"]


def test_loadtest_records_a_clients_failed_calls(keyed, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"acme": "sk-acme", "intruder": "sk-wrong"}))
    argv = ["--driver", FRONTEND, "--url", keyed.url, "--workload", "tot", "--scenario", "none",
            "--clients", "acme,intruder", "--duration", "1.5", "--rate", "4", "--param",
            "max_tokens=4", "--param", "depth=1", "--api-key-file", str(keys), "--no-progress",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert loadtest_main(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    table = {r["client"]: r for r in results["fairness"]}
    assert table["acme"]["calls_failed"] == 0 and table["acme"]["programs_done"] >= 1
    bad = table["intruder"]
    assert bad["calls_ok"] == 0 and bad["calls_failed"] >= 1
    assert bad["programs_failed"] == bad["programs_started"] >= 1
    assert sum(results["errors"].values()) == bad["calls_failed"]
    assert all("HTTP 401" in msg and "invalid API key" in msg for msg in results["errors"])


# ---------------------------------------------------------------------------------------------
# A server that is not there, or does not answer


def test_no_server_is_a_clear_error_not_a_hang(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EndpointUnreachable, match="Connection refused"):
        ClientEndpoint(url, "alice")
    argv = ["--url", url, "--program", "tot", "--client", "alice"]
    assert frontend_main(argv) == 2
    argv = ["--driver", FRONTEND, "--url", url, "--workload", "tot", "--scenario", "none",
            "--clients", "2", "--duration", "1"]  # fmt: skip
    assert loadtest_main(argv) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "cannot reach the server" in err[0] and "cannot reach URL" in err[1]


def test_a_silent_server_times_out(capture):
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        with pytest.raises(EndpointUnreachable, match="timeout"):
            ClientEndpoint(f"http://127.0.0.1:{silent.getsockname()[1]}", "a", timeout_s=0.5)
        assert time.monotonic() - t0 < 5

    capture.stall = 3.0  # answers /get_model_info, then hangs on /generate
    log = CallLog()
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    endpoint = ClientEndpoint(url, "alice", log=log, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ProgramFailed, match="timeout"):
        run_program(ToTProgram(branches=2, depth=1, max_tokens=4), endpoint, seed=0)
    assert time.monotonic() - t0 < 5
    [call] = log.close()  # the root's fork commit: nothing is sent after a failure
    assert call.state == "failed" and "timeout" in call.error and call.node == "000-fork"


def test_the_drain_cut_off_reports_a_stalled_call_and_returns(capture):
    """A program stuck on a silent server: the run still ends at its drain cut-off, with the
    call reported unfinished and its program not done (not dropped, not waited for)."""
    capture.stall = 30.0
    before = set(threading.enumerate())
    url = f"http://127.0.0.1:{capture.server_address[1]}"
    [c0] = build_clients("tot", None, num_clients=1, duration_s=0.3, rate=20.0)
    clients = [replace(c0, client="alice")]
    runs = frontend_runs(clients, 0.3, seed=0)[:1]
    programs = frontend_programs(clients, None, {"depth": 1, "max_tokens": 4})
    harness = HarnessConfig(url=url, duration_s=0.3, drain_timeout_s=0.3, call_timeout_s=30)
    t0 = time.monotonic()
    result = FrontendDriver(runs, programs, harness).run()
    assert time.monotonic() - t0 < 2.5 and 0.3 <= result.t_end_s < 2.0
    [call] = result.calls
    assert call.state == "unfinished" and call.node == "000-fork" and call.client == "alice"
    [run] = result.programs
    assert run.num_issued == 1 and not run.done and not run.failed
    assert not result.errors() and result.count("unfinished") == 1
    [row] = fairness_table(result, clients)
    assert row["programs_started"] == 1 and row["calls_unfinished"] == 1
    assert row["program_p50_s"] >= 0.3 - run.start_s  # counted with its age at the cut-off
    # The stalled call's thread outlives the run; end it here, not during a later test.
    capture.release.set()
    for thread in set(threading.enumerate()) - before:
        thread.join(5)
        assert not thread.is_alive()


def test_frontend_params_are_checked_before_the_server_is_contacted(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    argv = ["--driver", FRONTEND, "--url", url, "--workload", "judge", "--scenario", "none",
            "--clients", "2", "--duration", "1", "--param", "branches=3"]  # fmt: skip
    assert loadtest_main(argv) == 2
    err = capsys.readouterr().err
    assert "--param" in err and "unknown parameter branches" in err and "cannot reach" not in err
