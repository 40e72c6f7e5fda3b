"""FairServe's ``L_S`` over HTTP (issue 31 item 7): a declared ``system_len`` (body field or
``X-System-Len``), else a chat's system messages' tokens; it reaches the worker."""

from __future__ import annotations

import pytest

from sgl_fair.messages import Dispatch
from sgl_fair.request import Request
from sgl_fair.router import protocol as P
from sgl_fair.router.protocol.errors import ProtocolError
from sgl_fair.router.routes_openai import with_system_len
from sgl_fair.router.tokenizer import load_tokenizer
from sgl_fair.transport import decode, encode


def test_declared_in_the_body_or_a_header() -> None:
    hints = P.parse_hints({"system_len": 12})
    assert P.resolve_scheduling(hints, {}).system_len == 12
    assert P.resolve_scheduling(P.Hints(), {"x-system-len": "30"}).system_len == 30
    assert P.resolve_scheduling(hints, {"x-system-len": "30"}).system_len == 12  # body wins
    assert P.resolve_scheduling(P.Hints(), {}).system_len is None
    with pytest.raises(ProtocolError) as e:
        P.parse_hints({"system_len": -1})
    assert e.value.param == "system_len"
    with pytest.raises(ProtocolError) as e:
        P.resolve_scheduling(P.Hints(), {"x-system-len": "many"})
    assert e.value.param == "X-System-Len"


def test_a_chat_counts_its_system_messages() -> None:
    tok = load_tokenizer(None)
    msgs = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Answer in French."},
    ]
    want = sum(len(tok.encode(m["content"], add_special_tokens=False)) for m in (msgs[0], msgs[2]))
    item = P.GenItem(text="x", input_ids=None, sampling=None)
    assert with_system_len(item, msgs, tok, {}).hints.system_len == want > 0
    declared = P.GenItem(text="x", input_ids=None, sampling=None, hints=P.Hints(system_len=3))
    assert with_system_len(declared, msgs, tok, {}).hints.system_len == 3
    assert with_system_len(item, msgs, tok, {"x-system-len": "5"}).hints is None  # the header's
    assert with_system_len(item, msgs[1:2], tok, {}).hints is None  # no system message


def test_it_travels_to_the_worker() -> None:
    req = Request("r", "u", (1, 2, 3), 4, 0.0, app="chat", system_len=2)
    assert decode(encode(Dispatch(0, req, 0.0))).req.system_len == 2
