"""A router among several that share no service reports (replicas over SGLang servers, or
``--replica-state independent``) sees each worker's whole queue from its ``Load`` (issue 40,
item 4). Before, its ``queue_len`` counted only its own requests: a flood another replica
sent to worker 0 was invisible, and least-load kept sending there."""

from __future__ import annotations

import pytest

from sgl_fair.messages import Load
from sgl_fair.request import Request
from sgl_fair.router import Router, make_router_policy
from sgl_fair.router.state import build_router


def _req(rid: str) -> Request:
    return Request(rid=rid, client="c", input_ids=(1, 2, 3), output_len=4, arrival_s=0.0)


@pytest.mark.parametrize(("from_loads", "expect"), [(False, 0), (True, 1)])
def test_a_replica_takes_the_queue_other_routers_made_from_the_load(from_loads, expect):
    r = Router(make_router_policy("least-load"), 2, queues_from_loads=from_loads)
    r.handle(Load(0, 0.1, 6, 2, 0, 0, 1000), 0.1)  # 8 requests there, all another router's
    r.handle(Load(1, 0.1, 0, 1, 0, 0, 1000), 0.1)
    assert r.queue_len(0) == (8 if from_loads else 0)
    assert r.dispatch(_req("a"), 0.2).worker == expect
    for i in range(20):  # its own count wins once the Load is behind it
        r.dispatch(_req(f"b{i}"), 0.2)
    assert r.queue_len(0) + r.queue_len(1) >= 21


@pytest.mark.parametrize(
    ("argv", "on"),
    [
        ([], False),
        # over standalone workers, shared reports: the ledger's counts (ReplicaRouter)
        (["--worker-endpoint", "tcp://127.0.0.1:5000", "--tenant-limits-split", "2"], False),
        (["--worker-endpoint", "tcp://127.0.0.1:5000", "--tenant-limits-split", "2",
          "--replica-state", "independent"], True),
        # over SGLang servers, shared reports too: the plugin's ledger (a ReplicaRouter,
        # which takes the Load's counts only until a server's first report)
        (["--backend", "sglang", "--worker-url", "http://127.0.0.1:1",
          "--worker-kv-endpoint", "tcp://127.0.0.1:2", "--tenant-limits-split", "2"], False),
        (["--backend", "sglang", "--worker-url", "http://127.0.0.1:1",
          "--worker-kv-endpoint", "tcp://127.0.0.1:2", "--tenant-limits-split", "2",
          "--replica-state", "independent"], True),
    ],
)  # fmt: skip
def test_the_launcher_turns_it_on_for_replicas_without_shared_reports(argv, on):
    from sgl_fair.launch.config import parse_config

    router = build_router(parse_config(argv), follow_kv_events=True)
    assert router.queues_from_loads is on


def test_a_replica_takes_the_loads_counts_until_a_workers_first_report():
    """A worker whose service report never comes (an SGLang server whose plugin ledger its
    bridge cannot read) still shows every router's requests in its queue, from its Load."""
    from sgl_fair.messages import ServiceReport
    from sgl_fair.router.replica import ReplicaRouter

    r = ReplicaRouter(make_router_policy("least-load"), 2, replica=3)
    r.handle(Load(0, 0.1, 6, 2, 0, 0, 1000), 0.1)  # 8 there, none of them ours
    assert r.queue_len(0) == 8
    report = ServiceReport(boot=5, rows=((4, "c", 10, 0, 1),), requests=((4, 1),),
                           num_requests=1)  # fmt: skip
    r.handle(Load(0, 0.2, 0, 1, 0, 0, 1000, service=report), 0.2)
    assert r.queue_len(0) == 1  # from its report: the other replica's one request
