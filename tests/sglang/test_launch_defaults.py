"""The SGLang command line the launcher builds, read by SGLang 0.5.23's own ``ServerArgs``
parser: which of SGLang's behaviours it switches on, and which defaults it leaves to SGLang."""

from __future__ import annotations

import argparse

from sgl_fair.launch import parse_config, sglang_server_command

BASE = ["--backend", "sglang", "--model-path", "/models/tiny"]


def _parsed(args: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    argv, _env = sglang_server_command(parse_config([*BASE, *args]), 0, 31000, 32000)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv[3:])


def test_servers_stream_incrementally():
    """Cumulative chunks repeat every token so far: a 4,096-token stream is ~90 MB of JSON in
    the bridge. The bridge reads the server's mode from /server_info."""
    assert _parsed([]).incremental_streaming_output is True


def test_sglangs_own_batch_defaults_stand_unless_the_user_sets_them():
    """SGLang sizes --chunked-prefill-size and --max-running-requests per GPU; the launcher
    passes them only when given (the simulator keeps its own defaults)."""
    ns = _parsed([])
    assert (ns.chunked_prefill_size, ns.max_running_requests) == (None, None)
    ns = _parsed(["--chunked-prefill-size", "2048", "--max-running-requests", "48"])
    assert (ns.chunked_prefill_size, ns.max_running_requests) == (2048, 48)
    sim = parse_config([])
    assert (sim.chunked_prefill_size, sim.max_running_requests) == (8192, 256)


def test_the_worker_api_key_reaches_servers_and_bridges():
    from sgl_fair.launch.sglang import bridge_configs

    assert _parsed(["--worker-api-key", "sk-w"]).api_key == "sk-w"
    assert _parsed([]).api_key is None
    cfg = parse_config([*BASE, "--worker-api-key", "sk-w"])
    [b] = bridge_configs(cfg, "ipc:///tmp/x", ["http://127.0.0.1:31000"], [None])
    assert b.api_key == "sk-w" and "sk-w" not in repr(b)
    urls = ["--worker-url", "http://10.0.0.1:30000", "--worker-api-key", "sk-w"]
    assert parse_config(urls).worker_api_key == "sk-w"
