"""The plugin's waiting set (``worker/sglang/waiting_set.py``): what it keeps as requests
arrive, are admitted, retracted and leave equals the per-pass rebuild it replaces —
``sorted(waiting, key=arrival)`` and ``group_by_client`` of that — at every step."""

from __future__ import annotations

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
