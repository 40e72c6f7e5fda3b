"""The waiting queue's helpers (``worker/scheduler_state.py``): ``without`` equals the plain
filter it replaced, for any queue and any subset — equal arrival keys and out-of-order
queues included (it falls back to a lookup there)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.request import Request
from sgl_fair.worker.scheduler_state import enqueue, without


def queue(times: list[int], seqs: list[int]) -> list[Request]:
    return [
        Request(f"r{i}", "c", (1, 2), 1, float(t), seq=s)
        for i, (t, s) in enumerate(zip(times, seqs, strict=False))
    ]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    times=st.lists(st.integers(0, 5), min_size=1, max_size=80),
    seqs=st.lists(st.integers(0, 3), min_size=80, max_size=80),
    picks=st.lists(st.integers(0, 79), max_size=10),
    ordered=st.booleans(),
)
def test_without_is_the_filter(times, seqs, picks, ordered) -> None:
    reqs = queue(times, seqs)
    waiting: list[Request] = []
    if ordered:
        for r in reqs:
            enqueue(waiting, r)
        keys = [r.arrival_key() for r in waiting]
        assert keys == sorted(keys)
    else:
        waiting = list(reqs)  # whatever order: still right, just slower
    gone = list({id(waiting[i % len(waiting)]): waiting[i % len(waiting)] for i in picks}.values())
    ids = {id(r) for r in gone}
    assert without(waiting, gone) == [r for r in waiting if id(r) not in ids]
