"""What the bridge says to an SGLang server, against a real HTTP stand-in with SGLang's own
semantics (``sglang_standin.py``): exact aborts, incremental streaming, API keys, the plugin's
state at start. A real ``Bridge`` runs in a thread; the test plays the router over zmq."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_standin import BridgeRig, StandInSGLang  # noqa: E402

from sgl_fair.messages import FinishReason  # noqa: E402


def test_an_abort_ends_that_request_only_not_those_whose_rid_it_prefixes(tmp_path):
    """SGLang aborts every rid that starts with the given one: the bridge must send each call
    its own rid, of one fixed length, and abort by that."""
    rids = {"job1", "job1-1", "job10"}  # a request, its second sample, another tenant's
    with (
        StandInSGLang(token_interval_s=0.02) as server,
        BridgeRig(str(tmp_path), server.url, abort_grace_s=5.0) as rig,
    ):
        assert rig.hello() is not None
        for rid in sorted(rids):
            rig.dispatch(rid, 200, client="bob" if rid == "job10" else "alice")
        assert rig.recv_until(lambda m: False, timeout_s=0.5) is None  # all three run
        assert len(server.running) == 3
        rig.abort("job1")
        done = rig.finished({"job1"})
        assert done["job1"].reason is FinishReason.ABORTED
        rig.recv_until(lambda m: False, timeout_s=0.3)
        assert len(server.aborted) == 1, "an abort reached other requests"
        assert len(server.running) == 2
        sent = [body["rid"] for _a, body in server.calls("/generate")]
        assert len(set(sent)) == 3 and not set(sent) & rids  # SGLang never sees client rids
        assert len({len(r) for r in sent}) == 1  # one length: none is a prefix of another
        [(_a, abort)] = server.calls("/abort_request")
        assert abort["rid"] in sent and server.aborted == [abort["rid"]]
        for rid in ("job1-1", "job10"):
            rig.abort(rid)
        rest = rig.finished({"job1-1", "job10"})
        assert {r: f.reason for r, f in rest.items()} == dict.fromkeys(
            ("job1-1", "job10"), FinishReason.ABORTED
        )
        assert len(server.aborted) == 3


@pytest.mark.parametrize("incremental", [False, True])
def test_tokens_and_finished_carry_the_routers_rid(tmp_path, incremental):
    with (
        StandInSGLang(incremental=incremental) as server,
        BridgeRig(str(tmp_path), server.url) as rig,
    ):
        assert rig.hello() is not None
        rig.dispatch("r-7", 5)
        done = rig.finished({"r-7"})
        assert done["r-7"].reason is FinishReason.LENGTH
        assert done["r-7"].output_ids == (100, 101, 102, 103, 104)
        assert rig.tokens_of("r-7") == [100, 101, 102, 103, 104]


@pytest.mark.parametrize("low_first", [False, True])
def test_the_class_priority_follows_the_servers_direction(tmp_path, low_first):
    """BROS on SGLang: RT must outrank BE in the server's own direction; a server with
    --schedule-low-priority-values-first (it says so in /server_info) runs low values first,
    so there RT is the lower value (else waiting BE requests preempt running RT ones)."""
    from sgl_fair.request import ServiceClass

    info = {"schedule_low_priority_values_first": low_first}
    with (
        StandInSGLang(info=info) as server,
        BridgeRig(str(tmp_path), server.url, class_priority=True) as rig,
    ):
        assert rig.hello() is not None
        rig.dispatch("rt", 2, client="rt-client", service_class=ServiceClass.RT)
        rig.dispatch("be", 2, client="be-client", service_class=ServiceClass.BE)
        assert set(rig.finished({"rt", "be"})) == {"rt", "be"}
        sent = {b["routing_key"]: b["priority"] for _a, b in server.calls("/generate")}
        rt_sent, be_sent = sent["rt-client"], sent["be-client"]
        sign = 1 if low_first else -1  # SGLang: priority * sign, smallest first
        assert rt_sent * sign < be_sent * sign
        assert abs(rt_sent - be_sent) > 10  # SGLang's default preemption threshold


def test_every_call_to_a_server_with_an_api_key_carries_it(tmp_path):
    """SGLang with --api-key answers 401 to any call without ``Authorization: Bearer KEY``
    (but /health): the bridge sends it on every call (info, generate, abort, flush)."""
    from sgl_fair.messages import FlushCache, Flushed

    with (
        StandInSGLang(api_key="sk-worker", token_interval_s=0.02) as server,
        BridgeRig(str(tmp_path), server.url, api_key="sk-worker") as rig,
    ):
        hello = rig.hello()
        assert hello is not None and hello.kv_capacity_tokens == 20000  # /server_info read
        rig.dispatch("ok", 3)
        assert rig.finished({"ok"})["ok"].reason is FinishReason.LENGTH
        rig.dispatch("long", 500)
        assert rig.recv_until(lambda m: False, timeout_s=0.3) is None
        rig.abort("long")
        assert rig.finished({"long"})["long"].reason is FinishReason.ABORTED
        rig.send(FlushCache(0, 7))
        flushed = rig.recv_until(lambda m: isinstance(m, Flushed))
        assert flushed is not None and flushed.ok
        paths = {p for _m, p, _a, _b in server.seen}
        assert {"/server_info", "/generate", "/abort_request", "/flush_cache"} <= paths
        assert {a for _m, _p, a, _b in server.seen} == {"Bearer sk-worker"}
        assert server.aborted  # the abort was taken, not answered 401


PLUGIN = {"policy": "dlpm", "opts": {"weights": {"acme": 3.0}}}


@pytest.mark.parametrize(
    ("reported", "refused"),
    [(None, "runs no sgl-fair plugin"), ({"policy": "vtc", "opts": {}}, "policy 'vtc'"),
     (PLUGIN, None), ({"policy": "dlpm", "opts": {}}, None)],
    ids=["plain", "other-policy", "same", "other-options"],
)  # fmt: skip
def test_a_server_without_our_plugin_is_refused_at_start(tmp_path, caplog, reported, refused):
    """A --worker-url server started without SGLFAIR_SCHEDULE_POLICY runs SGLang's own
    scheduling: the bridge reads the plugin's state in /server_info and refuses the server
    (exit, one line) instead of serving unfairly under a banner that says otherwise."""
    from sgl_fair.worker.sglang.bridge import EXIT_NOT_FAIR

    info = {} if reported is None else {"sgl_fair": reported}
    with (
        StandInSGLang(info=info) as server,
        BridgeRig(str(tmp_path), server.url, expect_policy="dlpm",
                  expect_opts=PLUGIN["opts"]) as rig,
    ):  # fmt: skip
        hello = rig.hello(timeout_s=5)
        if refused is None:
            assert hello is not None and "(sgl-fair dlpm)" in hello.engine
            warned = [r.message for r in caplog.records if "options" in r.message]
            assert bool(warned) is (reported != PLUGIN)  # other weights: said, not refused
        else:
            assert hello is None
            rig.thread.join(5)
            assert rig.code == EXIT_NOT_FAIR
            assert any(refused in r.message for r in caplog.records), caplog.text
            assert not server.calls("/generate")


def test_a_server_that_refuses_the_info_call_is_refused_with_the_likely_cause(tmp_path, caplog):
    with (
        StandInSGLang(api_key="sk-worker", info={"sgl_fair": PLUGIN}) as server,
        BridgeRig(str(tmp_path), server.url, expect_policy="dlpm") as rig,
    ):  # no --worker-api-key: /server_info answers 401
        assert rig.hello(timeout_s=5) is None
        rig.thread.join(5)
        assert "needs --worker-api-key" in caplog.text


def test_the_bridge_reuses_its_connection_when_the_stream_ends_after_done(tmp_path):
    """The bridge reads a stream to its end after ``[DONE]``: aiohttp closes, rather than
    pools, a connection released before its response's end, and the end (chunked encoding's
    last chunk) often comes in a later packet. Without it every call to the server opened a
    new connection (at a few thousand calls a second, ports in TIME_WAIT run out)."""
    with (
        StandInSGLang(tail_delay_s=0.2) as server,
        BridgeRig(str(tmp_path), server.url) as rig,
    ):
        assert rig.hello() is not None
        for rid in ("first", "second", "third", "fourth"):
            rig.dispatch(rid, 2)
            assert rig.finished({rid})[rid].reason is FinishReason.LENGTH  # at [DONE]
            rig.recv_until(lambda m: False, timeout_s=0.4)  # the stream's end has come
    ports = server.generate_ports
    assert len(ports) == 4
    # a call on a connection an earlier call used: never before (each was closed); the
    # bridge's /health and /v1/loads polls share the pool, so not every call finds it free
    reused = sum(1 for i, p in enumerate(ports) if p in ports[:i])
    assert reused >= 1, ports
