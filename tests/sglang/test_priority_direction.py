"""BROS inside SGLang under both priority directions: the bridge sends each request's class as
SGLang's ``priority`` in the server's direction (``--schedule-low-priority-values-first`` or
not), and SGLang's real preemption rule (``PrefillAdder.preempt_to_schedule``) then lets a
waiting RT request preempt a running BE one, never the reverse; the plugin reads the class
back in the same direction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.managers.schedule_policy import PrefillAdder, SchedulePolicy
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
from sglang_rig import make_req, publish_server_args

from sgl_fair.request import Request, ServiceClass
from sgl_fair.worker.sglang.http_api import generate_body
from sgl_fair.worker.sglang.mirror import class_of


@pytest.fixture(params=[False, True], ids=["high-first", "low-first"])
def low_first(request):
    publish_server_args()
    get_context().set_server_args(
        ServerArgs(model_path="dummy", device="cpu", pp_max_micro_batch_size=1 << 20,
                   enable_priority_scheduling=True,
                   schedule_low_priority_values_first=request.param)
    )  # fmt: skip
    yield request.param
    get_context().set_server_args(
        ServerArgs(model_path="dummy", device="cpu", pp_max_micro_batch_size=1 << 20)
    )


def _sglang_req(cls: ServiceClass, low_first: bool, rid: str):
    ours = Request(rid=rid, client="c", input_ids=(1, 2, 3), output_len=4, arrival_s=0.0,
                   service_class=cls)  # fmt: skip
    body = generate_body(ours, class_priority=True, low_priority_first=low_first)
    req = make_req([1, 2, 3], "c", max_new_tokens=4, rid=rid)
    req.priority = body["priority"]
    req.full_untruncated_fill_ids = [1, 2, 3]
    req.prefix_len = 0
    req.time_stats.wait_queue_entry_time = 0.0
    return req


def _preempts(waiting, running) -> bool:
    """SGLang's real ``preempt_to_schedule``: whether ``waiting`` preempts ``running``."""
    released = []
    batch = SimpleNamespace(
        reqs=[running],
        release_req=lambda i, n: released.append(i),
        filter_batch=lambda keep_indices: None,
    )
    adder = SimpleNamespace(
        running_batch=batch,
        preempt_list=[],
        rem_total_tokens=0,
        priority_scheduling_preemption_threshold=10,  # SGLang's default
        memory_budget=SimpleNamespace(total_offset=0),
        _request_slot_reserve_for_req=lambda req: 0,
        _get_running_request_total_token_offset=lambda req: 1 << 20,
    )
    return PrefillAdder.preempt_to_schedule(adder, waiting) and adder.preempt_list == [running]


def test_rt_preempts_be_and_be_never_preempts_rt(low_first):
    rt = _sglang_req(ServiceClass.RT, low_first, "rt")
    be = _sglang_req(ServiceClass.BE, low_first, "be")
    assert _preempts(rt, be)
    assert not _preempts(_sglang_req(ServiceClass.BE, low_first, "be2"),
                         _sglang_req(ServiceClass.RT, low_first, "rt2"))  # fmt: skip
    queue = [be, rt]  # SGLang's own priority order puts RT first
    SchedulePolicy._sort_by_priority_and_fcfs(queue, 1 if low_first else -1)
    assert queue == [rt, be]
    assert class_of(rt, low_first) is ServiceClass.RT
    assert class_of(be, low_first) is ServiceClass.BE


def test_the_plugin_reads_the_schedulers_direction(low_first):
    from sglang_rig import Rig

    from sgl_fair.worker.sglang import plugin
    from sgl_fair.worker.sglang.settings import PluginSettings

    rig = Rig()
    rig.scheduler.schedule_low_priority_values_first = low_first  # set before the policy
    fair = plugin.install_policy(rig.scheduler, PluginSettings("bros", {}))
    try:
        rt = _sglang_req(ServiceClass.RT, low_first, "rt-in")
        assert fair.ledger.arrived(rt) is None
        assert fair.ledger.mirror(rt).service_class is ServiceClass.RT
    finally:
        fair.detach()
