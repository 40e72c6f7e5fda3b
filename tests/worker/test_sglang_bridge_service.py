"""A router replica's bridge and the plugin's service ledger (issue 40, item 6): the
``Dispatch``'s tag reaches the server in ``custom_params`` (a client's own value of that key
never does), and a replica's bridge reads the ledger from ``/server_info`` and sends it with
its ``Load``, once per read, as a standalone worker sends its own. A real ``Bridge`` before
the stand-in server (``sglang_standin.py``)."""

from __future__ import annotations

import logging
import time

from sglang_standin import BridgeRig, StandInSGLang

from sgl_fair.messages import Dispatch, Load, ServiceReport
from sgl_fair.request import INFLIGHT_PARAM, TAG_PARAM, Request

SERVICE = {"boot": 11, "rows": [[7, "alice", 140, 7, 1], [9, "bob", 30, 5, 2]], "full": True,
           "requests": [[7, 1]], "num_requests": 3, "interactions": []}  # fmt: skip


def _dispatch(rig, rid, tag, sampling=None, inflight=None):
    req = Request(rid=rid, client="alice", input_ids=(5, 6, 7), output_len=2,
                  arrival_s=time.time(), max_new_tokens=2, sampling=sampling,
                  cluster_inflight=inflight)  # fmt: skip
    rig.send(Dispatch(0, req, time.time(), tag=tag))


def test_the_dispatch_tag_reaches_the_server_and_a_clients_own_never_does(tmp_path):
    with StandInSGLang() as server, BridgeRig(str(tmp_path), server.url) as rig:
        assert rig.hello() is not None
        forged = {"custom_params": {TAG_PARAM: [1, 0], "mine": 3}}
        _dispatch(rig, "tagged", (5, 64), sampling=forged)
        _dispatch(rig, "plain", None, sampling=forged)
        assert set(rig.finished({"tagged", "plain"})) == {"tagged", "plain"}
        sent = [b["sampling_params"].get("custom_params") for _a, b in server.calls("/generate")]
        assert {TAG_PARAM: [5, 64], "mine": 3} in sent
        assert {"mine": 3} in sent  # untagged: the client's forged tag is taken out
        assert len(sent) == 2


def test_the_routers_count_of_calls_in_flight_reaches_the_server(tmp_path):
    """``Request.cluster_inflight`` (the share guard's measure) rides in ``custom_params``
    through a real bridge to a server that runs our plugin; a client's own value of that key
    never reaches the server, nor the count a server without the plugin."""
    plugin = {"sgl_fair": {"policy": "vtc"}}
    with StandInSGLang(info=plugin) as server, BridgeRig(str(tmp_path), server.url) as rig:
        assert rig.hello() is not None
        forged = {"custom_params": {INFLIGHT_PARAM: 1, "mine": 3}}
        _dispatch(rig, "counted", (5, 64), sampling=forged, inflight=24)
        _dispatch(rig, "plain", None, sampling=forged)
        assert set(rig.finished({"counted", "plain"})) == {"counted", "plain"}
        sent = [b["sampling_params"].get("custom_params") for _a, b in server.calls("/generate")]
        assert {TAG_PARAM: [5, 64], INFLIGHT_PARAM: 24, "mine": 3} in sent
        assert {"mine": 3} in sent
    with StandInSGLang() as server, BridgeRig(str(tmp_path / "plain"), server.url) as rig:
        assert rig.hello() is not None
        _dispatch(rig, "counted", None, sampling=forged, inflight=24)
        assert set(rig.finished({"counted"})) == {"counted"}
        sent = [b["sampling_params"].get("custom_params") for _a, b in server.calls("/generate")]
        assert sent == [{"mine": 3}]


def test_a_replicas_bridge_sends_the_plugins_ledger_with_its_load(tmp_path):
    info = {"sgl_fair": {"policy": "vtc"}, "internal_states": [{"sgl_fair": {
        "policy": "vtc", "service": SERVICE}}]}  # fmt: skip
    with (
        StandInSGLang(info=info) as server,
        BridgeRig(
            str(tmp_path), server.url, share_service=True, service_poll_interval_s=0.2
        ) as rig,  # fmt: skip
    ):
        assert rig.hello() is not None
        load = rig.recv_until(lambda m: isinstance(m, Load) and m.service is not None, 5.0)
        assert load is not None
        assert load.service == ServiceReport(
            11, ((7, "alice", 140, 7, 1), (9, "bob", 30, 5, 2)), True, ((7, 1),), 3, ()
        )
        time.sleep(0.5)
        loads = [m for m in rig.got if isinstance(m, Load)]
        with_service = [m for m in loads if m.service is not None]
        assert len(with_service) < len(loads)  # each report read goes out once


def test_a_single_routers_bridge_never_reads_the_ledger(tmp_path):
    info = {"sgl_fair": {"policy": "vtc"}, "internal_states": [{"sgl_fair": {
        "policy": "vtc", "service": SERVICE}}]}  # fmt: skip
    with StandInSGLang(info=info) as server, BridgeRig(str(tmp_path), server.url) as rig:
        assert rig.hello() is not None
        time.sleep(1.2)
        assert len(server.calls("/server_info")) == 1  # the start's plugin check only
        assert all(m.service is None for m in rig.got if isinstance(m, Load))


def test_a_server_whose_plugin_keeps_no_ledger_is_said_once(tmp_path, caplog):
    info = {"sgl_fair": {"policy": "vtc"}, "internal_states": [{"sgl_fair": {"policy": "vtc"}}]}
    with (
        caplog.at_level(logging.WARNING, logger="sgl_fair.bridge"),
        StandInSGLang(info=info) as server,
        BridgeRig(
            str(tmp_path), server.url, share_service=True, service_poll_interval_s=0.1
        ) as rig,  # fmt: skip
    ):
        assert rig.hello() is not None
        time.sleep(0.8)
        assert len(server.calls("/server_info")) >= 4
    said = [r for r in caplog.records if "keeps no service ledger" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
