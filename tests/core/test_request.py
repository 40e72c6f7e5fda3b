"""Request: validation and unscheduled copies."""

import pytest

from sgl_fair.request import SUBMITTED_FIELDS, Phase, Request, ServiceClass
from sgl_fair.workloads.traces import load_trace, save_trace


def make() -> Request:
    return Request(
        "r1",
        "alice",
        (1, 2, 3, 4),
        3,
        0.5,
        max_new_tokens=8,
        service_class=ServiceClass.RT,
        interaction_id="i",
        app="tot",
        stage=2,
        prefix_group="sys",
        group_prefix_len=2,
    )


def test_unscheduled_copy_keeps_what_was_submitted_and_nothing_else():
    req = make()
    req.phase, req.output_ids, req.num_computed, req.first_token_s = Phase.RUNNING, [9], 4, 1.0
    copy = req.unscheduled_copy()
    for name in SUBMITTED_FIELDS:
        assert getattr(copy, name) == getattr(req, name), name
    assert copy.phase is Phase.WAITING and copy.output_ids == [] and copy.num_computed == 0
    assert copy.first_token_s is None and copy.seq != req.seq
    assert "prefix_group" in SUBMITTED_FIELDS and "phase" not in SUBMITTED_FIELDS


def test_copies_save_their_prefix_group(tmp_path):
    path = tmp_path / "t.jsonl"
    save_trace([make().unscheduled_copy()], path)
    [back] = load_trace(path)
    assert (back.prefix_group, back.group_prefix_len) == ("sys", 2)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"input_ids": ()}, "at least one token"),
        ({"output_len": 0}, "output_len"),
        ({"max_new_tokens": 1}, "max_new_tokens"),
    ],
)
def test_invalid_requests_name_the_problem(kwargs, needle):
    args = {"rid": "r", "client": "c", "input_ids": (1,), "output_len": 2, "arrival_s": 0.0}
    with pytest.raises(ValueError, match=needle):
        Request(**{**args, **kwargs})
