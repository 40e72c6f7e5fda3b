"""The router <-> worker wire: a Dispatch carries every submitted field, sampling included."""

from __future__ import annotations

from sgl_fair.messages import Dispatch, Finished, FinishReason, Hello
from sgl_fair.request import SUBMITTED_FIELDS, Request
from sgl_fair.transport import decode, encode


def test_dispatch_round_trips_the_submitted_fields():
    sampling = {"temperature": 0.5, "stop_token_ids": [2, 3], "ignore_eos": True, "top_k": 20}
    req = Request(
        "r1", "alice", (1, 2, 3), 4, 0.5, max_new_tokens=8, return_logprob=True,
        logprob_start_len=1, top_logprobs_num=2, sampling=sampling,
    )  # fmt: skip
    req.output_ids.append(9)  # bookkeeping never travels
    back = decode(encode(Dispatch(3, req, 1.25)))
    assert isinstance(back, Dispatch) and (back.worker, back.sent_s) == (3, 1.25)
    for name in SUBMITTED_FIELDS:
        assert getattr(back.req, name) == getattr(req, name), name
    assert back.req.sampling == sampling and back.req.output_ids == []
    plain = decode(encode(Dispatch(0, Request("r2", "bob", (1,), 1, 0.0), 0.0)))
    assert plain.req.sampling is None


def test_worker_messages_round_trip():
    fin = Finished(
        1, 2.0, "r1", "alice", FinishReason.REJECTED, (1, 2), (), error="busy", retry_after_s=2.5
    )
    assert decode(encode(fin)) == fin
    hello = Hello(0, 1.0, 123, 4096, "sglang 0.5.23 tiny")
    assert decode(encode(hello)) == hello
