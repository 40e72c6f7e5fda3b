"""The plugin's waiting set (``worker/sglang/waiting_set.py``): what it keeps as requests
arrive, are admitted, retracted and leave equals the per-pass rebuild it replaces —
``sorted(waiting, key=arrival)`` and ``group_by_client`` of that — at every step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.policies.base import group_by_client
from sgl_fair.request import Request
from sgl_fair.worker.sglang.waiting_set import WaitingSet

OPS = st.lists(st.tuples(st.sampled_from(["arrive", "admit", "retract", "leave"]),
                         st.integers(0, 10_000), st.sampled_from("abc")),
               max_size=120)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_kept_order_and_groups_equal_the_rebuild(ops):
    ws = WaitingSet()
    waiting: dict[int, Request] = {}
    running: dict[int, Request] = {}
    t = 0.0
    for op, pick, client in ops:
        if op == "arrive":
            t += 0.001
            m = Request(rid=f"r{t}", client=client, input_ids=(1,), output_len=1, arrival_s=t)
            waiting[id(m)] = m
            ws.add(m, ("host", m.rid))
        elif op in ("admit", "leave") and waiting:
            m = list(waiting.values())[pick % len(waiting)]
            del waiting[id(m)]
            ws.remove(m)
            if op == "admit":
                running[id(m)] = m
        elif op == "retract" and running:
            m = list(running.values())[pick % len(running)]
            del running[id(m)]
            waiting[id(m)] = m
            ws.add(m, ("host", m.rid))
        ordered = sorted(waiting.values(), key=lambda m: (m.arrival_s, m.seq))
        assert ws.in_order() == ordered
        assert ws.hosts() == [("host", m.rid) for m in ordered]  # each with its mirror
        assert ws.groups() == group_by_client(ordered)
        assert len(ws) == len(waiting)


@settings(max_examples=100, deadline=None)
@given(OPS, st.lists(st.booleans(), max_size=120))
def test_the_touched_log_names_every_mirror_added_or_removed_since_the_last_take(ops, takes):
    """What the LPM index re-reads (``lpm_index.py``): every mirror that came or went."""
    ws = WaitingSet()
    ws.track()
    expected: set[int] = set()
    waiting: list[Request] = []
    t = 0.0
    for i, (op, pick, client) in enumerate(ops):
        if op == "arrive":
            t += 0.001
            m = Request(rid=f"r{t}", client=client, input_ids=(1,), output_len=1, arrival_s=t)
            waiting.append(m)
            ws.add(m)
            expected.add(id(m))
        elif waiting:
            m = waiting.pop(pick % len(waiting))
            ws.remove(m)
            expected.add(id(m))
        if i < len(takes) and takes[i]:
            assert set(ws.take_touched()) == expected
            expected = set()
    assert set(ws.take_touched()) == expected


def test_taking_the_log_without_tracking_raises_and_starts_nothing():
    ws = WaitingSet()
    with pytest.raises(RuntimeError):
        ws.take_touched()
    ws.add(Request(rid="r", client="a", input_ids=(1,), output_len=1, arrival_s=0.0))
    with pytest.raises(RuntimeError):  # (a failed take used to turn the log on)
        ws.take_touched()
