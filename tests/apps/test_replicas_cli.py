"""The launcher's many-host flags: one clear error line naming the flag for each misuse, and
the tenant limits split over replicas (``apps/launch/replicas.py``)."""

from __future__ import annotations

import pytest

from sgl_fair.config import parse_tenants
from sgl_fair.launch.config import parse_config
from sgl_fair.launch.replicas import split_limits


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--router-only"], "--router-only needs --worker-endpoint"),
        (["--worker-endpoint", "tcp://10.2.3.4:5000"], "--worker-keys DIR (CURVE) or --insecure"),
        (["--worker-endpoint", "127.0.0.1:5000"], "--worker-endpoint: expected tcp://HOST:PORT"),
        (["--worker-endpoint", "tcp://127.0.0.1:5000", "--dp", "2"], "--dp 2 does not match"),
        (["--backend", "sim", "--worker-endpoint", "tcp://127.0.0.1:5"], "--backend remote"),
        (["--router-replicas", "0"], "--router-replicas must be >= 1"),
        (["--worker-endpoint", "tcp://127.0.0.1:5", "--router-replicas", "2"],
         "--backend remote starts no workers to share"),
        (["--tenant-limits-split", "0"], "--tenant-limits-split must be >= 1"),
        (["--worker-endpoint", "tcp://127.0.0.1:5", "--worker-keys", "/nonexistent"],
         "router.key_secret is missing"),
    ],
)  # fmt: skip
def test_misuse_is_one_line_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_remote_endpoints_make_a_router_only_replica():
    cfg = parse_config(["--worker-endpoint", "tcp://127.0.0.1:5000",
                        "--worker-endpoint", "tcp://127.0.0.1:5002"])  # fmt: skip
    assert cfg.backend == "remote" and cfg.dp == 2 and cfg.replica_id is not None
    alone = parse_config(["--worker-endpoint", "tcp://127.0.0.1:5000",
                          "--replica-state", "independent"])  # fmt: skip
    assert alone.replica_id is None  # a plain Router: its own dispatches only
    off_host = parse_config(["--worker-endpoint", "tcp://10.2.3.4:5000", "--insecure"])
    assert off_host.worker_endpoints == ("tcp://10.2.3.4:5000",)


def test_a_router_over_sglang_servers_shares_service_only_as_one_of_several_replicas():
    """The plugin's ledger is read through /server_info, at a cost to the servers: a single
    router over them does not read it; one of R replicas (--tenant-limits-split R) does."""
    url = ["--backend", "sglang", "--worker-url", "http://127.0.0.1:31000"]
    single = parse_config(url)
    assert single.replica_id is None
    replica = parse_config([*url, "--tenant-limits-split", "2"])
    assert replica.replica_id is not None
    alone = parse_config([*url, "--tenant-limits-split", "2", "--replica-state", "independent"])
    assert alone.replica_id is None


def test_limits_split_over_replicas():
    table = parse_tenants({
        "defaults": {"max_inflight": 5, "rpm": 60},
        "tenant": [{"name": "a", "max_inflight": 9, "rpm": 600, "burst": 10, "weight": 2.0},
                   {"name": "b"}],
    })  # fmt: skip
    half = split_limits(table, 2)
    a = half.get("a")
    assert (a.max_inflight, a.rpm, a.burst, a.weight) == (5, 300.0, 5.0, 2.0)  # weight kept
    assert half.effective("nobody").max_inflight == 3 and half.effective("nobody").rpm == 30.0
    assert split_limits(table, 1) is table
    tiny = split_limits(parse_tenants({"tenant": [{"name": "t", "max_inflight": 1}]}), 4)
    assert tiny.get("t").max_inflight == 1  # never below one request


def test_a_watched_endpoints_file_is_remote_too(tmp_path, capsys):
    path = tmp_path / "workers.txt"
    path.write_text("tcp://127.0.0.1:5000\n")
    cfg = parse_config(["--worker-endpoints-file", str(path), "--router-only"])
    assert cfg.backend == "remote" and cfg.worker_endpoints_file == str(path)
    with pytest.raises(SystemExit):
        parse_config(["--worker-endpoints-file", str(tmp_path / "none.txt")])
    assert "--worker-endpoints-file" in capsys.readouterr().err


def test_a_router_over_torch_workers_starts_from_their_defaults():
    """--router-replicas with --backend torch: the replicas' --model is a torch preset the
    simulator does not know; they start from a torch worker's numbers."""
    import dataclasses

    from sgl_fair.launch.backends import backend_of

    cfg = parse_config(["--worker-endpoint", "tcp://127.0.0.1:5000"])
    kv, context = backend_of("remote").launch_limits(dataclasses.replace(cfg, model="tiny"))
    assert kv > 0 and context == 8192


def test_held_ports_keep_others_out_and_let_their_owner_listen():
    """The launcher holds its replicas' ports while their SGLang servers and bridges start:
    an outgoing connection's ephemeral port (a bridge polling a server's /health) once took a
    replica's port first (CI: "--port P is already in use" for replica 1)."""
    import socket

    from sgl_fair.launch.ports import hold_ports

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    held = hold_ports("127.0.0.1", [port])
    assert isinstance(held, list)
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # a plain bind (SGLang's own port picks)
        with socket.socket() as owner:  # the replica: uvicorn binds with SO_REUSEADDR
            owner.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            owner.bind(("127.0.0.1", port))
            owner.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                assert c.getsockname()[1] != port
    finally:
        for h in held:
            h.close()
    with socket.socket() as s2:
        s2.bind(("127.0.0.1", port))  # released


def test_a_taken_replica_port_is_refused_before_any_worker_starts(capsys):
    import socket

    from sgl_fair.launch.replicas import serve_replicas

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 1
        cfg = parse_config(["--dp", "1", "--router-replicas", "2", "--port", str(port)])
        assert serve_replicas(cfg) == 2
    err = capsys.readouterr().err
    assert "is in use" in err and "one per replica" in err


def test_each_replica_process_draws_its_own_id():
    """``--router-replicas`` restarts a replica with the config it started with; its id is
    drawn in the process, so the restarted one is a new row in the workers' ledgers."""
    import dataclasses

    from sgl_fair.launch.replicas import replica_process_config

    cfg = dataclasses.replace(parse_config(["--dp", "1"]), replica_id=5)
    ids = {replica_process_config(cfg).replica_id for _ in range(8)}
    assert len(ids) == 8 and 5 not in ids
    alone = dataclasses.replace(cfg, replica_id=None)  # --replica-state independent
    assert replica_process_config(alone).replica_id is None
