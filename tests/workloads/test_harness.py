"""The live load-test harness against an in-process fake SGLang server.

The fake server (``FakeSGLang``) speaks SGLang's native API — ``/health``, ``/server_info``
and streaming ``/generate`` with SSE ``data:`` lines, cumulative ``output_ids`` and
``meta_info`` — and logs what it received and when, on its own side of the socket. So the
checks below are about what really crossed the wire: closed-loop order (a child arrives only
after its parents' final chunk was written), child prompts built from the served outputs,
per-client API keys, injected failures.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import zlib
from dataclasses import replace

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from sgl_fair.loadtest import LoadTestConfig, LoadTestError, main, run_loadtest  # noqa: E402
from sgl_fair.workloads.harness import HarnessConfig, build_clients, drive  # noqa: E402
from sgl_fair.workloads.harness_report import fairness_table, harness_row  # noqa: E402
from sgl_fair.workloads.programs import Out, PromptOf, generate_programs  # noqa: E402

ROW_FIELDS = {
    "policy",
    "router",
    "local",
    "dp",
    "workload",
    "scenario",
    "p50_well_behaved_s",
    "p99_well_behaved_s",
    "throughput_tok_s",
    "jain",
    "jain_scope",
    "cache_hit_rate",
    "clients",
    "jain_actual",
    "misbehaving",
    "num_programs",
    "num_calls",
    "unfinished_calls",
    "makespan_s",
    "failed_calls",
}

# Small programs: a run of a few seconds makes dozens of calls.
SMALL = {
    "tot": {
        "branches": 2,
        "depth": 3,
        "header_len": 8,
        "question_len": 6,
        "instruction_len": 3,
        "thought_len": 5,
    },
    "judge": {
        "dimensions": 3,
        "header_len": 8,
        "article_len": 12,
        "dimension_instruction_len": 3,
        "judgement_len": 6,
        "merge_instruction_len": 3,
        "verdict_len": 5,
    },
    "longqa": {
        "questions": 2,
        "header_len": 4,
        "document_len": 30,
        "question_len": 4,
        "answer_len": 4,
    },
    "chat": {"max_turns": 3, "system_len": 8, "user_len": 6, "reply_len": 5, "think_s": 0.15},
}


def out_token(wire_rid: str, i: int) -> int:
    """The fake server's i-th output token of a request: a pure function of (rid, i)."""
    return 100 + zlib.crc32(f"{wire_rid}:{i}".encode()) % 29900


class FakeSGLang:
    """An SGLang-compatible server on 127.0.0.1 (own thread and event loop).

    ``fail_500`` / ``abort`` / ``stall``: regexes on the wire rid; a match answers HTTP 500,
    an ``abort`` finish after one chunk, or one chunk and then silence until the client
    hangs up. ``keys``: client → API key required as ``Authorization: Bearer``.
    ``incremental``: stream only the new ids per chunk (``--incremental-streaming-output``).
    """

    def __init__(
        self,
        *,
        dp_size: int = 2,
        tokens_per_chunk: int = 2,
        token_delay_s: float = 0.002,
        incremental: bool = False,
        keys: dict[str, str] | None = None,
        fail_500: str | None = None,
        abort: str | None = None,
        stall: str | None = None,
        throttle: str | None = None,
        queued: str | None = None,
    ) -> None:
        self.dp_size = dp_size
        self.tokens_per_chunk = tokens_per_chunk
        self.token_delay_s = token_delay_s
        self.incremental = incremental
        self.keys = keys
        self.fail_500 = re.compile(fail_500) if fail_500 else None
        self.abort = re.compile(abort) if abort else None
        self.stall = re.compile(stall) if stall else None
        self.throttle = re.compile(throttle) if throttle else None
        # With `queued`, meta_info.queue_time says 2.5 s for matching rids and 0.01 s for the
        # others (as sgl-fair and SGLang report it); without it, no queue_time at all.
        self.queued = re.compile(queued) if queued else None
        self.log: list[dict] = []
        self.cache: list[tuple[int, ...]] = []  # served prompt + output sequences
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._stopping = threading.Event()
        self.url = ""

    # ---- lifecycle ----

    def start(self) -> str:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/health", self.health)
            app.router.add_get("/server_info", self.server_info)
            app.router.add_post("/generate", self.generate)
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            host, port = self._runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake server did not start"
        return self.url

    def stop(self) -> None:
        self._stopping.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # ---- handlers ----

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "dp_size": self.dp_size,
                "router_policy": "fake-rr",
                "schedule_policy": "fake-fcfs",
                "schedule_policy_opts": {"q": 1},
                "model_path": "m",
            }
        )

    def _cached(self, ids: tuple[int, ...]) -> int:
        best = 0
        for seq in self.cache:
            n = 0
            for a, b in zip(seq, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body["rid"]
        ids = tuple(body["input_ids"])
        sp = body["sampling_params"]
        entry = {
            "rid": rid,
            "input_ids": ids,
            "client": request.headers.get("X-Client-Id"),
            "authorization": request.headers.get("Authorization"),
            "routing_key": body.get("routing_key"),
            "sampling_params": sp,
            "stream": body.get("stream"),
            "t_recv": time.monotonic(),
            "t_final": None,
            "disconnected": False,
        }
        self.log.append(entry)
        if self.keys is not None:
            want = self.keys.get(entry["client"] or "")
            if want is None or entry["authorization"] != f"Bearer {want}":
                return web.Response(status=401, text="bad api key")
        if self.fail_500 and self.fail_500.search(rid):
            return web.Response(status=500, text="injected failure")
        if self.throttle and self.throttle.search(rid):  # what our server says for FairServe
            limit = {"limit": "user", "max_requests": 1, "window_s": 60.0}
            error = {"message": "request throttled: user over its limit", "throttle": limit}
            return web.json_response({"error": error}, status=429, headers={"Retry-After": "60"})
        n = int(sp["max_new_tokens"])
        per_chunk = int(sp.get("stream_interval", self.tokens_per_chunk))
        out = [out_token(rid, i) for i in range(n)]
        cached = self._cached(ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        while sent < n:
            await asyncio.sleep(self.token_delay_s * per_chunk)
            if self.stall and self.stall.search(rid) and sent > 0:
                while not self._stopping.is_set():  # silence until the client hangs up
                    if request.transport is None or request.transport.is_closing():
                        entry["disconnected"] = True
                        break
                    await asyncio.sleep(0.02)
                return resp
            new = min(n, sent + per_chunk)
            finish = None
            if self.abort and self.abort.search(rid) and sent > 0:
                finish = {"type": "abort", "message": "injected abort"}
            elif new == n:
                finish = {"type": "length", "length": n}
            ids_out = out[sent:new] if self.incremental else out[:new]
            meta = {
                "id": rid,
                "prompt_tokens": len(ids),
                "completion_tokens": new,
                "cached_tokens": cached,
                "finish_reason": finish,
            }
            if self.queued is not None:
                meta["queue_time"] = 2.5 if self.queued.search(rid) else 0.01
            if finish is not None:
                entry["t_final"] = time.monotonic()  # before the client can see it
            line = "data: " + json.dumps(
                {"text": "x" * new, "output_ids": ids_out, "meta_info": meta}
            )
            raw = (line + "\n\n").encode()
            # Split every event across two writes: the client must reassemble lines.
            await resp.write(raw[: len(raw) // 2])
            await asyncio.sleep(0)
            await resp.write(raw[len(raw) // 2 :])
            sent = new
            if finish is not None:
                break
        if not (self.abort and self.abort.search(rid)):
            self.cache.append(ids + tuple(out))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def fake():
    servers: list[FakeSGLang] = []

    def make(**kw) -> FakeSGLang:
        server = FakeSGLang(**kw)
        server.start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_rid(server: FakeSGLang) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for e in server.log:
        assert e["rid"] not in out, f"rid {e['rid']} sent twice"
        out[e["rid"]] = e
    return out


def out_len(prog, node: str) -> int:
    return next(p.output_len for p in prog.calls if p.node == node)


def run_programs(server, name, scenario, *, clients, duration, rate, seed=0, **cfg):
    specs = build_clients(
        name, scenario, num_clients=clients, duration_s=duration, rate=rate, params=SMALL[name]
    )
    programs = generate_programs(specs, duration, seed=seed)
    assert programs, "the workload drew no program: pick another seed"
    config = HarnessConfig(url=server.url, duration_s=duration, run_tag="t", **cfg)
    result = asyncio.run(drive(programs, config))
    return specs, result


# ---------------------------------------------------------------- closed loop


@pytest.mark.parametrize(
    ("name", "clients"), [("tot", 2), ("judge", 2), ("chat", 4)], ids=["tot", "judge", "chat"]
)
def test_closed_loop_order_and_child_prompts(fake, name, clients):
    server = fake()
    _, result = run_programs(server, name, None, clients=clients, duration=1.0, rate=2.0)
    log = by_rid(server)
    assert result.count("ok") == len(result.calls) == len(log) > 0
    assert not result.stopped and all(p.done and not p.failed for p in result.programs)
    wire = {c.rid: c.wire_rid for c in result.calls}
    num_children = 0
    for prog in result.programs:
        for plan in prog.calls:
            child = log[wire[prog.rid(plan.node)]]
            expected: list[int] = []
            for part in plan.parts:
                if isinstance(part, Out):
                    w = wire[prog.rid(part.node)]
                    expected += [out_token(w, i) for i in range(out_len(prog, part.node))]
                elif isinstance(part, PromptOf):
                    expected += log[wire[prog.rid(part.node)]]["input_ids"]
                else:
                    expected += part
            assert list(child["input_ids"]) == expected, plan.node
            for parent in plan.parents:
                num_children += 1
                p = log[wire[prog.rid(parent)]]
                assert p["t_final"] is not None
                # Closed loop on the server's own clock: sent only after the final chunk.
                assert child["t_recv"] > p["t_final"], (plan.node, parent)
            if plan.parents:  # every kind: the first parent's prompt + output starts the child
                first = plan.parents[0]
                pw = wire[prog.rid(first)]
                head = list(log[pw]["input_ids"]) + [
                    out_token(pw, i) for i in range(out_len(prog, first))
                ]
                assert list(child["input_ids"][: len(head)]) == head
    assert num_children > 0
    # Calls carry the client three ways and ask for greedy, EOS-free, streamed output.
    for c in result.calls:
        e = log[c.wire_rid]
        assert e["client"] == e["routing_key"] == c.client
        assert e["sampling_params"] == {
            "max_new_tokens": c.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert e["stream"] is True and e["authorization"] is None
    if name == "chat":  # think time: a turn is due after its parent finished, and waits
        calls = {c.rid: c for c in result.calls}
        later = [c for c in result.calls if c.stage > 0]
        assert later
        for c in later:
            parent = calls[f"{c.program_id}/turn{c.stage}"]
            assert c.arrival_s > parent.finish_s
            assert c.send_s >= c.arrival_s - 1e-3


def test_records_and_events_follow_the_stream(fake):
    server = fake(incremental=True, tokens_per_chunk=1)
    specs, result = run_programs(
        server, "judge", "s1", clients=2, duration=1.0, rate=2.0, stream_interval=3
    )
    assert result.count("ok") == len(result.calls) > 0
    log = by_rid(server)
    for c in result.calls:
        assert c.output_ids == [out_token(c.wire_rid, i) for i in range(c.max_new_tokens)]
        assert c.chunk_tokens[-1] == c.completion_tokens == c.max_new_tokens
        assert c.chunk_tokens == sorted(c.chunk_tokens) and len(c.chunk_tokens) > 1
        assert log[c.wire_rid]["sampling_params"]["stream_interval"] == 3
        steps = [b - a for a, b in zip([0, *c.chunk_tokens], c.chunk_tokens, strict=False)]
        assert all(k == 3 for k in steps[:-1]) and 1 <= steps[-1] <= 3, steps
        assert c.send_s <= c.first_token_s == c.chunk_s[0] <= c.finish_s
        assert c.prompt_tokens == c.input_len == len(log[c.wire_rid]["input_ids"])
        evs = c.events()
        assert evs[0].kind.value == "prefill"
        assert evs[0].extend_len == c.input_len - c.cached_tokens
        assert sum(e.end - e.start for e in evs[1:]) == c.max_new_tokens
    # Merge calls extend their first dimension's prompt + output: the server found it cached.
    merges = [c for c in result.calls if c.node == "merge"]
    assert merges and all(c.cached_tokens > 0 for c in merges)
    rows = fairness_table(result, specs)
    assert sum(r["output_tokens"] for r in rows) == sum(c.max_new_tokens for c in result.calls)
    assert sum(r["input_tokens"] for r in rows) == sum(c.input_len for c in result.calls)
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-9
    assert rows[0]["role"] == "misbehaving" and rows[1]["role"] == "well-behaved"
    row = harness_row(result, specs, workload_name="judge", scenario="s1", dp=2, seed=0)
    assert set(row) >= ROW_FIELDS and row["misbehaving"] == ["c0"]
    assert row["num_calls"] == len(result.calls) and row["failed_calls"] == 0
    assert row["p50_well_behaved_s"] is not None and row["p50_well_behaved_s"] > 0
    assert row["cache_hit_rate"] > 0


# ---------------------------------------------------------------- failures


def test_failed_calls_are_counted_and_stop_their_program(fake):
    server = fake(
        fail_500=r"-c1-judge-0/dim0$", abort=r"-c1-judge-1/dim1$", stall=r"-c0-judge-0/dim0$"
    )
    _, result = run_programs(
        server, "judge", None, clients=2, duration=1.5, rate=3.0, seed=1, call_timeout_s=1.0
    )
    progs = {p.program_id: p for p in result.programs}
    assert {"c0-judge-0", "c1-judge-0", "c1-judge-1"} <= set(progs)
    failed = {c.rid: c for c in result.calls if c.state == "failed"}
    assert set(failed) == {"c1-judge-0/dim0", "c1-judge-1/dim1", "c0-judge-0/dim0"}
    assert failed["c1-judge-0/dim0"].status == 500
    assert "HTTP 500" in failed["c1-judge-0/dim0"].error
    assert "abort" in failed["c1-judge-1/dim1"].error
    assert "timeout" in failed["c0-judge-0/dim0"].error
    log = by_rid(server)
    for pid in ("c0-judge-0", "c1-judge-0", "c1-judge-1"):
        assert progs[pid].failed and progs[pid].done
        assert f"t-{pid}/merge" not in log  # the program stopped: no merge sent
    others = [p for p in result.programs if p.program_id not in failed_pids(failed)]
    assert others and all(p.done and not p.failed for p in others)
    records = {r.rid: r for r in result.records()}
    assert records["c1-judge-0/dim0"].rejected
    assert records["c1-judge-0/dim0"].reject_reason.startswith("HTTP 500")
    assert records["c1-judge-0/dim0"].finish_s is None
    row = harness_row(
        result, _specs("judge", 2), workload_name="judge", scenario=None, dp=1, seed=1
    )
    assert row["failed_calls"] == 3 and row["num_programs_failed"] == 3
    assert row["num_rejected"] == 3


def test_throttled_interactions_and_wasted_tokens_are_reported(fake):
    """A 429 throttle on a program's merge call: the program fails, its finished dimension
    calls are the wasted tokens (issue 14's report fields); a 500 is not a throttle."""
    server = fake(throttle=r"-c1-judge-0/merge$", fail_500=r"-c0-judge-1/dim0$")
    _, result = run_programs(
        server, "judge", None, clients=2, duration=1.5, rate=3.0, seed=1, call_timeout_s=5.0
    )
    row = harness_row(
        result, _specs("judge", 2), workload_name="judge", scenario=None, dp=1, seed=1
    )
    merge = next(c for c in result.calls if c.rid == "c1-judge-0/merge")
    assert merge.state == "failed" and merge.status == 429
    dims = [c for c in result.calls if c.program_id == "c1-judge-0" and c.state == "ok"]
    assert dims and row["tokens_wasted"] == sum(c.input_len + len(c.output_ids) for c in dims)
    assert row["calls_throttled"] == row["interactions_throttled"] == 1
    assert row["users_throttled"] == row["benign_users_throttled"] == 1
    assert row["abusive_users_throttled"] == 0  # no scenario: every client is well-behaved
    assert row["users_served_pct"] == 100.0  # both clients finished other programs


def test_throttled_users_are_split_by_what_the_workload_knows(fake):
    """Scenario S1 makes c0 the misbehaving client: its throttled calls count it abusive, a
    well-behaved client's count it benign."""
    server = fake(throttle=r"-c[01]-judge-0/merge$")
    specs, result = run_programs(
        server, "judge", "s1", clients=2, duration=1.5, rate=3.0, seed=1, call_timeout_s=5.0
    )
    assert [s.well_behaved for s in specs] == [False, True]
    row = harness_row(result, specs, workload_name="judge", scenario="s1", dp=1, seed=1)
    thr = {c.client for c in result.calls if c.status == 429}
    assert thr == {"c0", "c1"}
    assert row["users_throttled"] == 2
    assert row["abusive_users_throttled"] == row["benign_users_throttled"] == 1


@pytest.mark.parametrize("reported", [True, False])
def test_queueing_delay_is_what_the_server_reported(fake, reported):
    """Waiting-queue delay P50/P99 and % of users queued over 1 s come from the server's
    meta_info.queue_time (the client cannot see admission); None when the server says none."""
    server = fake(queued=r"-c1-judge-" if reported else None)
    _, result = run_programs(server, "judge", None, clients=2, duration=1.0, rate=3.0, seed=1)
    row = harness_row(
        result, _specs("judge", 2), workload_name="judge", scenario=None, dp=1, seed=1
    )
    ok = [c for c in result.calls if c.state == "ok"]
    assert ok and {c.client for c in ok} == {"c0", "c1"}
    if not reported:
        assert all(c.queue_s is None for c in result.calls)
        assert row["queue_delay_p50_s"] is row["users_queued_pct"] is None
        return
    assert {c.queue_s for c in ok if c.client == "c1"} == {2.5}
    assert {c.queue_s for c in ok if c.client == "c0"} == {0.01}
    assert row["users_queued_pct"] == 50.0
    assert row["queue_delay_p99_s"] == pytest.approx(2.5)
    assert row["queue_delay_p50_s"] in (pytest.approx(0.01), pytest.approx(1.255), 2.5)


def failed_pids(failed) -> set[str]:
    return {rid.split("/")[0] for rid in failed}


def _specs(name, n):
    return build_clients(name, None, num_clients=n, duration_s=1.0, params=SMALL[name])


def test_drain_timeout_cuts_off_and_counts_unfinished(fake):
    server = fake(stall=r"-c0-longqa-0/q0$")
    t0 = time.monotonic()
    _, result = run_programs(
        server, "longqa", None, clients=2, duration=1.0, rate=2.0, drain_timeout_s=0.5
    )
    took = time.monotonic() - t0
    assert took < 1.0 + 0.5 + 1.0
    stalled = next(c for c in result.calls if c.rid == "c0-longqa-0/q0")
    assert stalled.state == "unfinished" and stalled.finish_s is None
    assert stalled.first_token_s is not None  # one chunk came before the silence
    assert result.t_end_s == pytest.approx(1.5, abs=0.3)
    row = harness_row(
        result, _specs("longqa", 2), workload_name="longqa", scenario=None, dp=1, seed=0
    )
    assert row["unfinished_calls"] == 1 and row["failed_calls"] == 0
    # The cut-off hung up: the server saw the disconnect (SGLang aborts the request then).
    deadline = time.monotonic() + 2
    while not by_rid(server)[stalled.wire_rid]["disconnected"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert by_rid(server)[stalled.wire_rid]["disconnected"]


# ---------------------------------------------------------------- run_loadtest and the CLI


def _small_params(name: str) -> dict:
    return {k: v for k, v in SMALL[name].items() if k != "dimensions"}


def test_run_loadtest_writes_outputs(fake, tmp_path):
    server = fake(dp_size=3)
    out = tmp_path / "lt"
    results = run_loadtest(
        LoadTestConfig(
            url=server.url,
            workload="judge",
            scenario="s1",
            clients=3,
            duration_s=2.0,
            rate=1.5,
            params=_small_params("judge"),
            out=out,
        )
    )
    row = results["row"]
    assert set(row) >= ROW_FIELDS
    assert row["dp"] == 3 and results["run"]["dp_source"] == "server"  # from /server_info
    assert row["policy"] == "fake-rr+fake-fcfs" and row["router"] == "fake-rr"
    assert row["local"] == "fake-fcfs" and row["local_opts"] == {"q": 1}
    assert row["workload"] == "judge" and row["scenario"] == "s1"
    assert row["num_calls"] == len(server.log) > 0 and row["failed_calls"] == 0
    assert results["totals"]["calls_ok"] == len(server.log)
    # c0 misbehaves with 16 dimensions per program (S1): far more calls per program.
    fair = {r["client"]: r for r in results["fairness"]}
    assert fair["c0"]["role"] == "misbehaving" and fair["c1"]["role"] == "well-behaved"
    assert set(fair) == {"c0", "c1", "c2"}
    for name in ("requests.jsonl", "results.json", "report.md", "timeline.png"):
        assert (out / name).is_file(), name
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == len(server.log)
    first = json.loads(lines[0])
    for key in ("send_s", "ttft_s", "chunk_s", "chunk_tokens", "finish_s", "prompt_tokens"):
        assert key in first
    assert first["status"] == 200 and first["state"] == "ok" and first["output_ids"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["row"]["num_calls"] == row["num_calls"]
    assert saved["run"]["url"] == server.url and saved["run"]["server_info"]["dp_size"] == 3
    assert saved["run"]["workload"] == "judge" and saved["run"]["start_time"]
    report = (out / "report.md").read_text()
    assert "## Fairness" in report and "misbehaving" in report and "timeline.png" in report


def test_api_keys_from_file_are_sent_per_client(fake, tmp_path):
    keys = {"c0": "sk-zero", "c1": "sk-one", "c2": "sk-two"}
    server = fake(keys=keys)
    key_file = tmp_path / "keys.toml"
    key_file.write_text("".join(f'{c} = "{k}"\n' for c, k in keys.items()))
    results = run_loadtest(
        LoadTestConfig(
            url=server.url,
            workload="longqa",
            scenario=None,
            clients=3,
            duration_s=1.0,
            rate=2.0,
            params=SMALL["longqa"],
            api_key_file=key_file,
            write=False,
        )
    )
    assert results["totals"]["calls_failed"] == 0 and results["totals"]["calls_ok"] > 0
    assert results["run"]["api_keys_for"] == ["c0", "c1", "c2"]
    assert "sk-zero" not in json.dumps(results)  # keys never land in the results
    assert {e["client"] for e in server.log} == {"c0", "c1", "c2"}
    for e in server.log:
        assert e["authorization"] == f"Bearer {keys[e['client']]}"
        assert e["rid"].split("-", 1)[1].startswith(e["client"] + "-")
    # A wrong key is a failed call (401), reported, not fatal.
    (tmp_path / "bad.json").write_text(json.dumps({**keys, "c1": "sk-wrong"}))
    results = run_loadtest(
        LoadTestConfig(
            url=server.url,
            workload="longqa",
            scenario=None,
            clients=3,
            duration_s=1.0,
            rate=2.0,
            params=SMALL["longqa"],
            api_key_file=tmp_path / "bad.json",
            write=False,
        )
    )
    fair = {r["client"]: r for r in results["fairness"]}
    assert fair["c1"]["calls_failed"] > 0 and fair["c1"]["calls_ok"] == 0
    assert fair["c0"]["calls_failed"] == 0 and fair["c0"]["calls_ok"] > 0
    assert any("HTTP 401" in msg for msg in results["errors"])
    # A client without a key: an error naming it, before anything is sent.
    (tmp_path / "short.json").write_text(json.dumps({"c0": "sk-zero", "c1": "sk-one"}))
    sent = len(server.log)
    with pytest.raises(LoadTestError, match="'c2'"):
        run_loadtest(
            LoadTestConfig(
                url=server.url,
                workload="longqa",
                scenario=None,
                clients=3,
                duration_s=1.0,
                api_key_file=tmp_path / "short.json",
                write=False,
            )
        )
    assert len(server.log) == sent


def _cli(url: str, *extra: str) -> list[str]:
    return ["--url", url, "--workload", "judge", "--scenario", "s1", "--duration", "1", *extra]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--clients", "1"], "--clients must be >= 2"),
        (["--clients", "3", "--rate", "-1"], "--rate"),
        (["--clients", "3", "--rate", "1", "--rate-scale", "2"], "--rate and --rate-scale"),
        (["--clients", "3", "--dp", "0"], "--dp"),
        (["--clients", "3", "--param", "nope"], "--param"),
        (["--clients", "3", "--param", "bogus_len=3"], "--param"),
        (["--clients", "3", "--api-key-file", "/nonexistent/keys.toml"], "--api-key-file"),
        (["--clients", "x"], "--clients"),
        (["--clients", "3", "--duration", "0"], "--duration"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(fake, capsys, args, needle):
    server = fake()
    assert main(_cli(server.url, *args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not server.log


def test_cli_other_usage_errors(capsys):
    port = free_port()
    cases = [
        (["--url", f"http://127.0.0.1:{port}", "--workload", "judge", "--scenario", "s1",
          "--clients", "3", "--duration", "1"], "cannot reach URL"),
        (["--workload", "judge", "--scenario", "s1", "--clients", "3", "--duration", "1"],
         "--url"),
        (["--url", "http://x", "--workload", "nope", "--scenario", "s1", "--clients", "3",
          "--duration", "1"], "--workload"),
        (["--url", "http://x", "--workload", "chat", "--scenario", "s1", "--clients", "4",
          "--duration", "1"], "--scenario"),
        (["--url", "http://x", "--workload", "judge", "--scenario", "s3", "--clients", "4",
          "--duration", "1"], "--scenario"),
        (["--url", "ftp://x", "--workload", "judge", "--scenario", "s1", "--clients", "4",
          "--duration", "1"], "--url"),
        (["--url", f"http://127.0.0.1:{port}", "--workload", "judge", "--scenario", "s1",
          "--clients", "3", "--duration", "1", "--param", "bogus_len=3"], "--param"),
    ]  # fmt: skip
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (argv, err)
        assert "Traceback" not in err[0]


def test_cli_short_run_prints_the_fairness_table(fake, capsys, tmp_path):
    server = fake()
    params = [f"--param={k}={v}" for k, v in SMALL["longqa"].items()]
    argv = ["--url", server.url, "--workload", "longqa", "--scenario", "s1", "--clients", "3"]
    argv += ["--duration", "2", "--rate", "1", "--no-progress", "--out", str(tmp_path), *params]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for needle in ("c0", "misbehaving", "well-behaved", "Jain", "TTFT p50 s", "programs/s"):
        assert needle in out, needle
    assert (tmp_path / "results.json").is_file()
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["row"]["dp"] == 2  # the fake server's dp_size
    assert results["totals"]["well_behaved_metric"] == "ttft"

    assert main([*argv, "--json", "--out", str(tmp_path / "j")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["row"]) >= ROW_FIELDS and data["totals"]["calls_ok"] > 0


def test_cli_exits_1_when_no_call_succeeds(fake, capsys, tmp_path):
    server = fake(fail_500=".")
    params = [f"--param={k}={v}" for k, v in SMALL["longqa"].items()]
    argv = ["--url", server.url, "--workload", "longqa", "--scenario", "none", "--clients", "2"]
    argv += ["--duration", "1", "--rate", "3", "--no-progress", "--out", str(tmp_path), *params]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "no call succeeded" in captured.err and "HTTP 500" in captured.err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["totals"]["calls_ok"] == 0
    assert results["totals"]["calls_failed"] == len(server.log) > 0


def test_rate_sets_a_normal_clients_rate_and_keeps_misbehaviour():
    specs = build_clients("longqa", "s1", num_clients=3, duration_s=10, rate=0.7)
    assert [c.arrivals.rate_per_s for c in specs] == pytest.approx([2.8, 0.7, 0.7])
    mixed = build_clients("mixed", "s1", num_clients=4, duration_s=10, rate=0.5, dp=4)
    assert [c.kind for c in mixed] == ["tot", "judge", "longqa", "chat"]
    assert [c.arrivals.rate_per_s for c in mixed] == pytest.approx([0.5] * 4)
    assert dict(mixed[0].params) == {"branches": 4}  # the S1 misbehaver's trees
    base = build_clients("judge", None, num_clients=2, duration_s=10, dp=2, rate_scale=1.5)
    assert [c.arrivals.rate_per_s for c in base] == pytest.approx([3.0, 3.0])


def test_unreachable_and_missing_flags_do_not_leave_files(tmp_path):
    with pytest.raises(LoadTestError, match="cannot reach URL"):
        run_loadtest(
            LoadTestConfig(
                url=f"http://127.0.0.1:{free_port()}",
                workload="judge",
                scenario="s1",
                clients=2,
                duration_s=1,
                out=tmp_path / "x",
            )
        )
    assert not (tmp_path / "x").exists()


def test_sse_parser_survives_odd_lines():
    from sgl_fair.workloads.loadclient import CallFailed, CallRecord, apply_chunk

    rec = CallRecord("p/a", "t-p/a", "c", "p", "a", "judge", 0, 4, 3, 0.0)
    assert not apply_chunk(rec, {"output_ids": [], "meta_info": {"completion_tokens": 0}}, 0.1)
    assert rec.first_token_s is None
    assert not apply_chunk(rec, {"output_ids": [7, 8], "meta_info": {"prompt_tokens": 4}}, 0.2)
    assert rec.first_token_s == 0.2 and rec.cached_tokens is None
    meta = {"completion_tokens": 3, "cached_tokens": 2, "finish_reason": {"type": "length"}}
    assert apply_chunk(rec, {"output_ids": [7, 8, 9], "meta_info": meta}, 0.3)
    assert rec.output_ids == [7, 8, 9] and rec.chunk_tokens == [2, 3]
    assert rec.finish_s == 0.3 and rec.finish_reason == "length"
    with pytest.raises(CallFailed, match="server error"):
        apply_chunk(rec, {"error": {"message": "boom"}}, 0.4)
    rec2 = CallRecord("p/b", "t-p/b", "c", "p", "b", "judge", 0, 4, 3, 0.0)
    with pytest.raises(CallFailed, match="abort"):
        apply_chunk(rec2, {"meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}, 1)
    # A missing cached_tokens counts as nothing cached.
    rec.state = "ok"
    assert rec.events()[0].extend_len == 4 - 2
    rec3 = CallRecord("p/c", "t-p/c", "c", "p", "c", "judge", 0, 4, 1, 0.0)
    apply_chunk(rec3, {"output_ids": [5], "meta_info": {"finish_reason": "length"}}, 0.5)
    assert rec3.events()[0].extend_len == 4


def test_stop_cuts_the_run_short_and_still_reports(fake):
    """Ctrl-C's path: ``stop()`` ends issuing and draining at once; what ran is reported."""
    server = fake(stall=r"/q0$")  # every first question hangs, so calls are in flight
    specs = build_clients("longqa", None, num_clients=2, duration_s=3.0, rate=3.0)
    specs = [replace(c, params=SMALL["longqa"]) for c in specs]
    programs = generate_programs(specs, 3.0, seed=0)
    config = HarnessConfig(url=server.url, duration_s=3.0, run_tag="t")

    def on_start(stop):
        asyncio.get_running_loop().call_later(0.5, stop)

    t0 = time.monotonic()
    result = asyncio.run(drive(programs, config, on_start=on_start))
    assert time.monotonic() - t0 < 1.5
    assert result.stopped and result.t_end_s == pytest.approx(0.5, abs=0.2)
    started = result.started_programs
    assert 0 < len(started) < len(programs)
    assert result.count("unfinished") >= 1 and result.count("failed") == 0
    row = harness_row(result, specs, workload_name="longqa", scenario=None, dp=1, seed=0)
    assert row["stopped"] and row["num_programs_started"] == len(started)
    assert row["num_programs"] == len(programs)


def test_loadtest_report_says_whom_it_throttled(fake, tmp_path):
    from sgl_fair.loadtest.output import render_report, totals_lines

    server = fake(throttle=r"-c0-judge-0/merge$")
    results = run_loadtest(
        LoadTestConfig(
            url=server.url, workload="judge", scenario="s1", clients=2, duration_s=1.5,
            rate=3.0, params=_small_params("judge"), seed=1, out=tmp_path / "lt",
        )
    )  # fmt: skip
    line = next(x for x in totals_lines(results) if x.startswith("throttled:"))
    assert "1 interactions of 1 users (1 misbehaving, 0 well-behaved)" in line, line
    assert line in render_report(results)
