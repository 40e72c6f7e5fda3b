"""``--backend sglang`` in the launcher: the SGLang command lines, the flags' checks and the
server processes' lifecycle. Nothing here starts SGLang (tests/sglang/test_gpu_launch.py does,
on a GPU)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sgl_fair.config import load_tenants
from sgl_fair.launch import (
    bridge_configs,
    free_ports,
    parse_config,
    sglang_server_command,
    sglang_servers,
)
from sgl_fair.launch.sglang import server_kv_endpoint as _kv_endpoint_of
from sgl_fair.launch.sglang import server_kv_replay
from sgl_fair.launch.sglang import server_url as _url_of
from sgl_fair.worker.sglang.servers import ServerGroup, ServerProcess, WatchedWorker
from sgl_fair.worker.sglang.settings import settings_from_env

TENANTS = """
[[tenant]]
name = "acme"
api_keys = ["sk-acme"]
weight = 3.0

[[tenant]]
name = "globex"
api_keys = ["sk-globex"]
"""


def _flags(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command line (the last one of each flag)."""
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return str(path)


def test_server_commands_place_ranks_publish_kv_events_and_pass_flags_through(tenants_file):
    args = ["--backend", "sglang", "--model-path", "/models/tiny", "--dp", "2", "--tp", "2"]
    args += ["--tenants", tenants_file, "--schedule-policy-opt", "quantum=512"]
    args += ["--chunked-prefill-size", "4096", "--max-running-requests", "64"]
    args += ["--mem-fraction-static", "0.4", "--disable-cuda-graph", "--load-format=dummy"]
    cfg = parse_config(args)
    assert cfg.backend == "sglang" and cfg.dp == 2
    assert cfg.sglang_args == ("--mem-fraction-static", "0.4", "--disable-cuda-graph",
                               "--load-format=dummy")  # fmt: skip
    tenants = load_tenants(tenants_file)
    ports = free_ports(4)
    cmds = [
        sglang_server_command(
            cfg, i, ports[2 * i], ports[2 * i + 1], tenants=tenants, environ={"PATH": "/bin"}
        )
        for i in range(2)
    ]
    for i, (argv, env) in enumerate(cmds):
        assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
        f = _flags(argv)
        assert f["--model-path"] == "/models/tiny" and f["--host"] == "127.0.0.1"
        assert f["--port"] == str(ports[2 * i])
        assert f["--base-gpu-id"] == str(2 * i) and f["--tp-size"] == "2"
        assert f["--dp-size"] == "1"  # data parallelism is ours: one rank per server
        assert f["--chunked-prefill-size"] == "4096" and f["--max-running-requests"] == "64"
        assert json.loads(f["--kv-events-config"]) == {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{ports[2 * i + 1]}",
            "bind": True,
            "topic": "",
        }
        assert "--context-length" not in f and "--served-model-name" not in f
        assert argv[-4:] == list(cfg.sglang_args)  # last: they may override ours
        assert _url_of(argv) == f"http://127.0.0.1:{ports[2 * i]}"
        assert _kv_endpoint_of(argv) == f"tcp://127.0.0.1:{ports[2 * i + 1]}"
        # The plugin's switch: our policy with its options and the tenants' weights.
        assert env["PATH"] == "/bin"
        settings = settings_from_env(env)
        assert settings is not None and settings.policy == "dlpm"
        assert settings.opts == {"quantum": 512, "weights": {"acme": 3.0, "globex": 1.0}}
        assert "SGLANG_PLUGINS" not in env


@pytest.mark.parametrize(
    "ep", ["tcp://127.0.0.1:5557", "tcp://10.0.3.4:5557", "tcp://[::1]:5557",
           "tcp://sglang-0.svc:5557", "ipc:///tmp/kv"],
)  # fmt: skip
def test_loopback_private_and_named_kv_endpoints_are_taken(ep):
    cfg = parse_config(["--worker-url", "http://a:1", "--worker-kv-endpoint", ep])
    assert cfg.worker_kv_endpoints == (ep,)


@pytest.mark.parametrize(
    ("addresses", "refused"),
    [(["93.184.215.14"], True), (["93.184.215.14", "10.1.2.3"], False), (["127.0.0.1"], False)],
)
def test_a_kv_endpoints_host_name_is_judged_by_what_it_resolves_to(
    monkeypatch, capsys, addresses, refused
):
    """A name whose every address is public is refused as a public address is; one with a
    private (or loopback) address is taken. The resolver's answer is given: there is no DNS
    here."""
    import socket

    real = socket.getaddrinfo

    def resolve(host, *args, **kw):
        if host != "kv.example.com":
            return real(host, *args, **kw)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    argv = ["--worker-url", "http://a:1", "--worker-kv-endpoint", "tcp://kv.example.com:5557"]
    if not refused:
        assert parse_config(argv).worker_kv_endpoints == ("tcp://kv.example.com:5557",)
        return
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert "--worker-kv-endpoint tcp://kv.example.com:5557: a public address" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("policy", "guard", "on"),
    [("vtc", None, True), ("dlpm", None, True), ("fcfs", None, False), ("vtc", "off", False),
     ("fcfs", "on", True)],
)  # fmt: skip
def test_the_share_guard_is_sglangs_priority_preemption(policy, guard, on):
    """A fair policy's servers run SGLang's priority scheduling (the plugin's share guard
    preempts through it: worker/sglang/share_preempt.py); --share-guard off, or a baseline,
    leaves SGLang's admission without preemption."""
    args = ["--backend", "sglang", "--model-path", "/m", "--schedule-policy", policy]
    cfg = parse_config([*args, *(["--share-guard", guard] if guard else [])])
    argv, _env = sglang_server_command(cfg, 0, 31000, 31001)
    assert ("--enable-priority-scheduling" in argv) is on
    assert "--retraction-policy" not in argv  # that is BROS's (its classes' priorities)


def test_optional_flags_and_a_plugin_whitelist():
    cfg = parse_config(
        ["--backend", "sglang", "--model-path", "m", "--context-length", "4096",
         "--served-model-name", "tiny", "--schedule-policy", "fcfs"]
    )  # fmt: skip
    argv, env = sglang_server_command(cfg, 0, 1, 2, environ={"SGLANG_PLUGINS": "other"})
    f = _flags(argv)
    assert f["--context-length"] == "4096" and f["--served-model-name"] == "tiny"
    assert f["--tp-size"] == "1" and f["--base-gpu-id"] == "0"
    assert env["SGLANG_PLUGINS"] == "other,sgl_fair"  # a whitelist would skip our plugin
    assert settings_from_env(env).policy == "fcfs"


def test_each_server_gets_its_own_ports_and_log(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cfg = parse_config(["--backend", "sglang", "--model-path", "m", "--dp", "3"])
    group = sglang_servers(cfg, None)
    ports = [int(_flags(s.argv)["--port"]) for s in group.servers]
    kv_ports = [int(_kv_endpoint_of(s.argv).rsplit(":", 1)[1]) for s in group.servers]
    replays = [server_kv_replay(s.argv) for s in group.servers]  # the launcher's keep one
    replay_ports = [int(r.rsplit(":", 1)[1]) for r in replays if r]
    assert len(replay_ports) == 3 and all(r.startswith("tcp://127.0.0.1:") for r in replays)
    every = ports + kv_ports + replay_ports
    assert len(set(every)) == 9 and cfg.port not in every
    logs = [s.log_path for s in group.servers]
    assert len(set(logs)) == 3 and all(p.startswith(str(tmp_path)) for p in logs)
    assert group.first_exit() is None  # nothing started
    # Held until the servers bind them: nothing else takes one (a plain bind, as an outgoing
    # connection's ephemeral port would), while a server's own SO_REUSEADDR listener can.
    for port in every:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    with socket.socket() as owner:
        owner.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        owner.bind(("127.0.0.1", ports[0]))
        owner.listen()
    group.stop()  # and let go with the servers
    with socket.socket() as other:
        other.bind(("127.0.0.1", ports[0]))


def test_the_plugin_refuses_batch_selecting_policies():
    """RR only chooses whole running batches: SGLang's scheduler cannot host it, so the plugin
    refuses it at start-up instead of silently running arrival order. BROS also has an
    admission order (``BROS.order``), which the plugin runs."""
    with pytest.raises(ValueError, match="whole running batch"):
        settings_from_env({"SGLFAIR_SCHEDULE_POLICY": "rr"})
    assert settings_from_env({"SGLFAIR_SCHEDULE_POLICY": "bros"}).policy == "bros"
    assert settings_from_env({"SGLFAIR_SCHEDULE_POLICY": "vtc"}).policy == "vtc"


def test_worker_urls_make_the_workers():
    cfg = parse_config(
        ["--worker-url", "http://10.0.0.1:30000/", "--worker-url", "http://10.0.0.2:30000",
         "--worker-kv-endpoint", "tcp://10.0.0.1:5557", "--worker-kv-endpoint",
         "tcp://10.0.0.2:5557", "--health-check-timeout", "3"]
    )  # fmt: skip
    assert cfg.backend == "sglang" and cfg.dp == 2
    assert cfg.worker_urls == ("http://10.0.0.1:30000", "http://10.0.0.2:30000")
    assert cfg.worker_kv_endpoints == ("tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557")
    assert cfg.startup_timeout_s == 900.0  # loading a model takes minutes
    [b0, b1] = bridge_configs(cfg, "ipc:///tmp/x", cfg.worker_urls, [None, None])
    assert (b0.wid, b0.url, b1.wid, b1.url) == (0, cfg.worker_urls[0], 1, cfg.worker_urls[1])
    assert b0.health_timeout_s == 3.0 and b0.server_pid is None


def test_sim_is_unchanged():
    cfg = parse_config([])
    assert (cfg.backend, cfg.dp, cfg.startup_timeout_s, cfg.sglang_args) == ("sim", 1, 120.0, ())
    assert parse_config(["--dp", "2"]).dp == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--backend", "sglang"], "--backend sglang needs --model-path"),
        (["--worker-url", "http://a:1", "--worker-url", "http://b:1", "--worker-kv-endpoint",
          "tcp://a:2"], "--worker-kv-endpoint given 1 times for 2 --worker-url"),
        (["--bogus", "3"], "unrecognized arguments: --bogus 3"),
        (["--backend", "sim", "--mem-fraction-static", "0.5"], "unrecognized arguments"),
        (["--worker-url", "http://a:1", "--mem-fraction-static", "0.5"],
         "with --worker-url it starts none"),
        (["--worker-url", "http://a:1", "--dp", "2"], "--dp 2 does not match the 1 --worker-url"),
        (["--worker-url", "a:1"], "is not an http:// or https:// URL"),
        (["--worker-url", "http://a:1", "--worker-kv-endpoint", "a:2"], "not a zmq tcp://"),
        (["--backend", "sglang", "--model-path", "m", "--worker-kv-endpoint", "tcp://a:2"],
         "--worker-kv-endpoint needs --worker-url"),
        (["--backend", "sim", "--worker-url", "http://a:1"], "need --backend sglang"),
        (["--worker-url", "http://a:1", "--worker-kv-endpoint", "tcp://a:2",
          "--worker-kv-replay-endpoint", "tcp://a:3", "--worker-kv-replay-endpoint", "tcp://a:4"],
         "--worker-kv-replay-endpoint given 2 times for 1 --worker-kv-endpoint"),
        (["--worker-url", "http://a:1", "--worker-kv-endpoint", "tcp://a:2",
          "--worker-kv-replay-endpoint", "a:3"], "is not a zmq tcp:// or ipc:// endpoint"),
        (["--worker-url", "http://a:1", "--health-check-timeout", "0"],
         "--health-check-timeout must be > 0"),
        (["--backend", "sglang", "--model-path", "m", "--schedule-policy", "rr"],
         "chooses whole running batches"),
        (["--torch-dtype", "float16"], "--torch-dtype: only with --backend torch"),
        (["--backend", "sglang", "--model-path", "m", "--time-scale", "2"],
         "--time-scale: --backend sglang does not use it"),
        (["--worker-url", "http://a:1", "--worker-kv-endpoint", "tcp://8.8.8.8:5557"],
         "--worker-kv-endpoint tcp://8.8.8.8:5557: a public address"),
        (["--worker-url", "http://a:1", "--worker-kv-endpoint", "tcp://[2001:4860::1]:5557"],
         "a public address"),
        (["--worker-url", "http://a:1", "--sim-eos", "off"],
         "--sim-eos: --backend sglang does not use it"),
        (["--worker-url", "http://a:1", "--gpu", "A10G-24GB"],
         "--gpu: --backend sglang does not use it"),
        (["--backend", "sglang", "--model-path", "m", "--kv-allocator", "paged"],
         "--kv-allocator: SGLang servers allocate their own KV"),
        (["--kv-allocator-opt", "block_size=8"],
         "--kv-allocator-opt: name the allocator with --kv-allocator"),
        (["--kv-allocator", "token", "--kv-allocator-opt", "block_size=8"],
         "--kv-allocator-opt: KV allocator 'token' has no option 'block_size'"),
        (["--kv-allocator", "paged", "--kv-allocator-opt", "block_size=0"],
         "--kv-allocator-opt: block_size must be an integer >= 1 (got 0)"),
        (["--kv-allocator", "bidirectional", "--kv-allocator-opt", "host_capacity_tokens=lots"],
         "host_capacity_tokens must be an integer >= 0 (got 'lots')"),
        (["--kv-allocator", "paged", "--kv-allocator-opt", "block_size"],
         "--kv-allocator-opt takes KEY=VALUE (got 'block_size')"),
    ],
)  # fmt: skip
def test_flag_errors_are_one_line(args, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err


def test_kv_allocator_opts_reach_every_worker() -> None:
    from types import SimpleNamespace

    from sgl_fair.launch.serve import sim_worker_configs

    cfg = parse_config(["--dp", "2", "--sim-text", "off", "--kv-allocator", "bidirectional",
                        "--kv-allocator-opt", "block_size=8",
                        "--kv-allocator-opt", "host_capacity_tokens=64"])  # fmt: skip
    assert cfg.kv_allocator_opts == {"block_size": 8, "host_capacity_tokens": 64}
    tokenizer = SimpleNamespace(vocab_size=32000, output_token_range=(1, 100), eos_token_id=2)
    state = SimpleNamespace(
        service=SimpleNamespace(endpoints=SimpleNamespace(base="ipc:///tmp/x")),
        tokenizer=tokenizer,
        tenants=None,
    )
    workers = sim_worker_configs(cfg, state)
    assert len(workers) == 2
    for w in workers:
        assert (w.kv_allocator, w.kv_allocator_opts) == ("bidirectional", cfg.kv_allocator_opts)


# ---- the server processes ----------------------------------------------------------------------


def _python(tmp_path, name: str, code: str) -> ServerProcess:
    return ServerProcess(
        0, [sys.executable, "-c", code], dict(os.environ), str(tmp_path / f"{name}.log")
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


class _Bridge:  # what WatchedWorker needs of a multiprocessing.Process
    exitcode = None

    def is_alive(self) -> bool:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc")
def test_a_server_that_dies_at_start_up_is_reported_with_its_log(tmp_path):
    code = "import sys\nfor i in range(30): print('line', i)\nsys.exit(3)"
    server = _python(tmp_path, "dies", code)
    group = ServerGroup([server])
    group.start()
    watched = WatchedWorker(_Bridge(), server)
    for _ in range(100):
        if group.first_exit() is not None:
            break
        time.sleep(0.05)
    assert group.first_exit() is server and server.exitcode() == 3
    assert not watched.is_alive() and "SGLang server 0" in watched.exitcode
    assert server.log_path in watched.exitcode
    tail = server.log_tail(5).splitlines()
    assert tail == [f"line {i}" for i in range(25, 30)]
    group.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc")
def test_stop_ends_the_server_and_its_children(tmp_path):
    # A "server" that forks a child (as SGLang forks its scheduler) and ignores SIGTERM.
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    server = _python(tmp_path, "stubborn", code)
    group = ServerGroup([server])
    group.start()
    child_pid = None
    for _ in range(100):
        with open(server.log_path) as f:
            text = f.read().strip()
        if text:
            child_pid = int(text)
            break
        time.sleep(0.05)
    assert child_pid is not None and _alive(child_pid)
    t0 = time.monotonic()
    group.stop(timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert server.exitcode() == -signal.SIGKILL
    for _ in range(50):
        if not _alive(child_pid):
            break
        time.sleep(0.05)
    assert not _alive(child_pid), "the server's child outlived it"


# ---- the launcher with a stand-in for sglang.launch_server ---------------------------------------

FAKE_LAUNCH_SERVER = '''
"""Stands in for ``python -m sglang.launch_server``: records what it was given, then serves
SGLang's native API with sgl-fair's simulator on the same port and model directory."""
import json, os, sys
args = sys.argv[1:]
flag = lambda name: args[len(args) - 1 - args[::-1].index(name) + 1]
record = os.environ["FAKE_SGLANG_RECORD"]
with open(os.path.join(record, f"server-{flag('--port')}.json"), "w") as f:
    json.dump({"argv": args, "env": dict(os.environ), "pid": os.getpid()}, f)
if os.environ.get("FAKE_SGLANG_FAIL"):
    print("loading the model ...")
    print("RuntimeError: no CUDA GPUs are available", flush=True)
    sys.exit(7)
os.execv(sys.executable, [sys.executable, "-m", "sgl_fair.launch", "--port", flag("--port"),
                          "--model-path", flag("--model-path"), "--time-scale", "inf"])
'''


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """``sglang.launch_server`` on PYTHONPATH is the stand-in above; returns its record dir."""
    pytest.importorskip("tokenizers")
    sys.path.insert(0, str(Path(__file__).parent.parent / "router"))
    from test_tokenizer import make_hf_dir

    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    record = tmp_path / "record"
    record.mkdir()
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(fake) + (os.pathsep + path if path else ""))
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    return make_hf_dir(tmp_path), record


def _records(record) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(record.glob("server-*.json"))]


@pytest.mark.slow
def test_launch_starts_watches_and_stops_its_servers(fake_sglang, tmp_path):
    model, record = fake_sglang
    sys.path.insert(0, str(Path(__file__).parent.parent / "router"))
    from live_helpers import launched

    args = ["--backend", "sglang", "--model-path", str(model), "--dp", "2"]
    args += ["--health-check-interval", "0.2", "--health-check-timeout", "1", "--enable-foo"]
    with launched(*args, tmp_path=tmp_path) as s:
        servers = _records(record)
        assert len(servers) == 2
        for rec in servers:
            assert rec["argv"][-1] == "--enable-foo"  # passed through
            assert settings_from_env(rec["env"]).policy == "dlpm"  # the plugin is on
        info = s.info()
        assert [w["alive"] for w in info["workers"]] == [True, True]
        urls = {w["url"] for w in info["workers"]}
        assert urls == {f"http://127.0.0.1:{_flags(r['argv'])['--port']}" for r in servers}
        r = httpx.post(s.url + "/generate", json={"text": "hi there"}, timeout=30)
        assert r.status_code == 200, r.text
        # A server that dies takes its worker out of routing at once (the launcher watches it).
        by_port = {_flags(rec["argv"])["--port"]: rec for rec in servers}
        victim = by_port[info["workers"][0]["url"].rsplit(":", 1)[1]]
        os.killpg(victim["pid"], signal.SIGKILL)
        for _ in range(100):
            w0 = s.info()["workers"][0]
            if not w0["alive"]:
                break
            time.sleep(0.05)
        assert not w0["alive"] and "SGLang server 0" in w0["death"], w0
        r = httpx.post(s.url + "/generate", json={"text": "still here"}, timeout=30)
        assert r.status_code == 200, r.text
    for rec in servers:  # every server is gone with the launcher
        for _ in range(100):
            if not _alive(rec["pid"]):
                break
            time.sleep(0.05)
        assert not _alive(rec["pid"])


@pytest.mark.slow
def test_a_server_failing_at_start_up_is_one_error_with_its_log(fake_sglang, monkeypatch):
    model, _record = fake_sglang
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "1")
    out = subprocess.run(
        [sys.executable, "-m", "sgl_fair.launch", "--backend", "sglang", "--model-path",
         str(model), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    err = [line for line in out.stderr.splitlines() if line.startswith("launch: error:")]
    assert len(err) == 1 and "SGLang server 0 exited with code 7 during start-up" in err[0]
    assert "server-0.log" in err[0]
    assert "no CUDA GPUs are available" in out.stderr  # the tail of its log
