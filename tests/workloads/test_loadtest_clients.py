"""``--clients`` as names and ``--driver``: parsing and validation (no server, no sglang)."""

from __future__ import annotations

import pytest

from sgl_fair.loadtest import FRONTEND, LoadTestConfig, LoadTestError
from sgl_fair.loadtest.cli import _parse_clients, build_parser, config_from_args
from sgl_fair.loadtest.config import validate
from sgl_fair.loadtest.run import _clients

BASE = ["--url", "http://127.0.0.1:9", "--workload", "tot", "--scenario", "s1", "--duration", "2"]


def test_clients_is_a_count_or_names():
    assert _parse_clients("3") == (3, None)
    assert _parse_clients(" alice, bob ") == (2, ("alice", "bob"))
    with pytest.raises(LoadTestError, match="--clients"):
        _parse_clients("alice,,bob")
    config = config_from_args(build_parser().parse_args([*BASE, "--clients", "alice,bob"]))
    assert config.clients == 2 and config.client_names == ("alice", "bob")
    assert config.driver == "native"


def test_named_clients_keep_the_workloads_roles_in_order():
    config = config_from_args(build_parser().parse_args([*BASE, "--clients", "mallory,bob,eve"]))
    clients = _clients(validate(config), dp=1)
    assert [c.client for c in clients] == ["mallory", "bob", "eve"]
    assert [c.well_behaved for c in clients] == [False, True, True]  # c0 misbehaves in S1
    assert clients[0].params == {"branches": 4}  # the token-level S1 misbehaviour


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"clients": 2, "client_names": ("a", "a")}, "distinct names"),
        ({"clients": 3, "client_names": ("a", "b")}, "distinct names"),
        ({"clients": 2, "client_names": ("a", "b c")}, "whitespace"),
        ({"clients": 2, "driver": "grpc"}, "--driver must be one of"),
        ({"clients": 2, "driver": FRONTEND, "workload": "longqa"}, "runs workload tot or judge"),
    ],
)
def test_bad_names_and_drivers_are_usage_errors(changes, needle):
    fields = {"url": "http://x", "workload": "tot", "scenario": "s1", "duration_s": 1.0}
    with pytest.raises(LoadTestError, match=needle):
        validate(LoadTestConfig(**{**fields, **changes}))
