"""The SGLang command line the launcher builds is one SGLang 0.5.23 itself accepts: parsed by
its own ``ServerArgs`` parser and ``KVEventsConfig`` (CPU; no server is started)."""

from __future__ import annotations

import argparse

from sgl_fair.launch import parse_config, sglang_server_command


def test_sglang_parses_the_server_command():
    from sglang.srt.disaggregation.kv_events import KVEventsConfig, parse_advertisable_tcp
    from sglang.srt.server_args import ServerArgs

    cfg = parse_config(
        ["--backend", "sglang", "--model-path", "/models/tiny", "--dp", "2", "--tp", "2",
         "--context-length", "4096", "--served-model-name", "tiny",
         "--load-format", "dummy", "--mem-fraction-static", "0.3"]
    )  # fmt: skip
    argv, _env = sglang_server_command(cfg, 1, 31000, 32000)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])
    assert (ns.model_path, ns.host, ns.port) == ("/models/tiny", "127.0.0.1", 31000)
    assert (ns.base_gpu_id, ns.tp_size, ns.dp_size) == (2, 2, 1)
    assert (ns.chunked_prefill_size, ns.max_running_requests) == (None, None)  # SGLang's
    assert (ns.context_length, ns.served_model_name) == (4096, "tiny")
    assert (ns.load_format, ns.mem_fraction_static) == ("dummy", 0.3)  # passed through
    kv = KVEventsConfig.from_cli(ns.kv_events_config)
    assert (kv.publisher, kv.bind, kv.topic) == ("zmq", True, "")
    assert parse_advertisable_tcp(kv.endpoint) == ("127.0.0.1", 32000)


def test_bros_runs_sglangs_priority_scheduling_and_its_bridges_send_the_class():
    """``--schedule-policy bros`` on SGLang: the servers run priority scheduling (a waiting RT
    request may preempt running BE ones) and retract by priority (BE first), and the
    bridges send each request's class as ``priority``. A fair policy's servers run priority
    scheduling for the share guard (not with ``--share-guard off``), and nothing else."""
    from sglang.srt.server_args import ServerArgs

    from sgl_fair.launch.sglang import bridge_configs

    base = ["--backend", "sglang", "--model-path", "/models/tiny"]
    for policy, on, guard in (("bros", True, True), ("vtc", False, True), ("vtc", False, False)):
        flags = [] if guard else ["--share-guard", "off"]
        cfg = parse_config([*base, "--schedule-policy", policy, *flags])
        argv, env = sglang_server_command(cfg, 0, 31000, 32000)
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv[3:])
        assert ns.enable_priority_scheduling is guard
        assert (ns.retraction_policy == "priority") is on
        assert env["SGLFAIR_SCHEDULE_POLICY"] == policy
        [b] = bridge_configs(cfg, "ipc:///tmp/x", ["http://127.0.0.1:31000"], [None])
        assert b.class_priority is on
