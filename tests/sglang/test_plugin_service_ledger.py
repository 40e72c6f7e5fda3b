"""The plugin's service ledger (issue 40, item 6): router replicas over SGLang servers share
D2LPM's state as over standalone workers. A request a replica tagged (``TAG_PARAM``:
``[replica, charge]`` in ``custom_params``, what our bridge sends) is charged to that
replica's (replica, client) row when it arrives in SGLang's scheduler, and its output when it
ends, however it ends; ``/server_info`` shows the snapshot (``report()["service"]``), which
another replica's ``ReplicaState`` turns into that replica's service. Driven through SGLang's
real ``Req`` and ``SamplingParams`` and our installed plugin."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_rig import Rig, make_req

from sgl_fair.messages import ServiceReport
from sgl_fair.request import TAG_PARAM
from sgl_fair.router.replica_state import ReplicaState
from sgl_fair.worker.sglang import plugin
from sgl_fair.worker.sglang.settings import PluginSettings

pytestmark = pytest.mark.usefixtures("plugin_hooks")


def tagged(ids, client, tag, rid=None, max_new_tokens=16):
    req = make_req(ids, client, max_new_tokens=max_new_tokens, rid=rid)
    req.sampling_params = SamplingParams(
        max_new_tokens=max_new_tokens, custom_params={TAG_PARAM: tag}
    )
    return req


def service(fair) -> ServiceReport:
    """What ``/server_info`` shows, as the bridge reads it back (JSON builtins)."""
    raw = msgspec.json.decode(msgspec.json.encode(fair.report()["service"]))
    return msgspec.convert(raw, ServiceReport)


def rows(report: ServiceReport) -> dict[tuple[int, str], tuple[int, int]]:
    return {(r, c): (e, o) for r, c, e, o, _ in report.rows}


def finish(fair, reqs, n_out, aborted=()):
    for r in reqs:
        r.output_ids = [9] * n_out
        r.finished_reason = FINISH_ABORT("gone") if r in aborted else FINISH_LENGTH(n_out)
    fair.after_batch(SimpleNamespace(reqs=list(reqs)))


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_each_replicas_dispatches_are_its_rows(policy):
    rig = Rig()
    fair = plugin.install_policy(rig.scheduler, PluginSettings(policy, {}))
    try:
        a1 = tagged([1, 2, 3, 4], "alice", [7, 100])
        a2 = tagged([1, 2, 3, 5], "alice", [7, 40], rid="dup")
        b1 = tagged([6, 7, 8], "alice", [9, 30], rid="dup")  # another replica, the same rid
        c1 = tagged([5, 5, 5], "carol", [9, 12])
        plain = make_req([4, 4, 4], "dave")  # no tag: a client that reached SGLang directly
        forged = tagged([3, 3], "eve", [7, -5])  # not a tag: ignored, never a row
        reqs = [a1, a2, b1, c1, plain, forged]
        for r in reqs:
            assert fair.ledger.arrived(r) is None
            rig.queue(r)
        first = service(fair)
        assert first.full and first.num_requests == 6  # every request held, tagged or not
        assert rows(first) == {(7, "alice"): (140, 0), (9, "alice"): (30, 0),
                               (9, "carol"): (12, 0)}  # fmt: skip
        assert dict(first.requests) == {7: 2, 9: 2}
        rig.admit()
        finish(fair, [a1, b1, plain], 5)
        finish(fair, [a2, c1, forged], 2, aborted=(c1,))  # an abort counts what it served
        last = service(fair)
        assert last.boot == first.boot and last.full
        assert rows(last) == {(7, "alice"): (140, 7), (9, "alice"): (30, 5),
                              (9, "carol"): (12, 2)}  # fmt: skip
        assert last.requests == () and last.num_requests == 0

        # replica 9's view of the server: its first report is a baseline, then replica 7's
        # service since, and never its own
        view = ReplicaState(9)
        assert view.report(0, 1.0, first) == []
        assert view.report(0, 2.0, last) == [("alice", 0, 7)]
        assert view.peer_requests(0) == 0
    finally:
        fair.detach()


def test_a_request_the_policy_refuses_still_charges_its_replicas_row():
    """Its replica charged the client at dispatch: the row counts it, with no request kept."""
    rig = Rig()
    fair = plugin.install_policy(rig.scheduler, PluginSettings("rpm", {"limit": 1}))
    try:
        ok, over = tagged([1, 2], "alice", [3, 50]), tagged([1, 3], "alice", [3, 60])
        assert fair.ledger.arrived(ok) is None
        assert fair.ledger.arrived(over) is not None  # over its rpm: refused
        report = service(fair)
        assert rows(report) == {(3, "alice"): (110, 0)}
        assert dict(report.requests) == {3: 1}
    finally:
        fair.detach()
