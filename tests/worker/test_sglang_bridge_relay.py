"""The bridge's relay path, cheap per token: a stream event read through a struct of the
fields the bridge uses (``StreamState.feed_bytes``) says exactly what the general path says,
and the tokens of every stream read in one pass of the event loop leave as one ``Tokens``
message, never after a message sent later (a ``Finished`` never overtakes its tokens)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import zmq

from sgl_fair.messages import Load, Tokens
from sgl_fair.transport import Endpoints, decode
from sgl_fair.worker.sglang.bridge import Bridge, BridgeConfig
from sgl_fair.worker.sglang.http_api import StreamState, decode_json

_FIELDS = ("output_ids", "cached_tokens", "queue_s", "finish", "error", "logprobs")

_META = {"id": "x", "prompt_tokens": 9, "weight_version": "default", "e2e_latency": 0.1}
STREAMS = [
    # cumulative, SGLang's usual shape: text and counters the bridge skips
    [{"text": "a", "output_ids": [5], "meta_info": {**_META, "cached_tokens": 3,
                                                     "finish_reason": None}},
     {"text": "ab", "output_ids": [5, 6], "meta_info": {**_META, "queue_time": 0.25}},
     {"text": "abc", "output_ids": [5, 6, 7],
      "meta_info": {"finish_reason": {"type": "length", "length": 3}, "cached_tokens": 4}}],
    # odd values: a bool cached count, a negative and a bool queue time, no meta at all
    [{"output_ids": [1], "meta_info": {"cached_tokens": True, "queue_time": -1}},
     {"output_ids": [1, 2], "meta_info": {"queue_time": True}},
     {"output_ids": [1, 2, 3]},
     {"output_ids": None, "meta_info": None}],
    # an error event, then a stray non-object
    [{"output_ids": [1], "meta_info": {}}, {"error": {"message": "too long", "code": 400}}],
    [[1, 2, 3]],
    [{"output_ids": [4], "meta_info": {"finish_reason": {"type": "abort", "message": "m"}},
      "error": None}],
]  # fmt: skip


def _state(s: StreamState) -> tuple:
    return tuple(getattr(s, f) for f in _FIELDS)


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("stream", range(len(STREAMS)))
def test_feed_bytes_reads_what_feed_reads(stream, incremental):
    fast, slow = StreamState(incremental=incremental), StreamState(incremental=incremental)
    for event in STREAMS[stream]:
        payload = json.dumps(event).encode()
        assert fast.feed_bytes(payload) == slow.feed(decode_json(payload))
        assert _state(fast) == _state(slow)


def test_feed_bytes_with_logprobs_and_bad_json():
    fast, slow = StreamState(want_logprobs=True), StreamState(want_logprobs=True)
    event = {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.5, 1, None]]}}
    payload = json.dumps(event).encode()
    assert fast.feed_bytes(payload) == slow.feed(decode_json(payload)) == [1]
    assert fast.logprobs == slow.logprobs == {"output_token_logprobs": [[-0.5, 1, None]]}
    with pytest.raises(ValueError):
        StreamState().feed_bytes(b"{not json")
    with pytest.raises(msgspec.DecodeError):
        StreamState().feed_bytes(b'{"output_ids": [1')


def test_tokens_of_one_pass_leave_as_one_message_before_anything_sent_later(tmp_path):
    ep = Endpoints.ipc(str(tmp_path))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(ep.router_in)

    def received() -> list:
        out = []
        while pull.poll(200):
            out.append(decode(pull.recv()))
        return out

    async def main() -> tuple[list, list]:
        bridge = Bridge(BridgeConfig(wid=3, endpoints=ep.base, url="http://127.0.0.1:9"))
        try:
            bridge.tokens("a", (1,))
            bridge.tokens("b", (2, 3))
            bridge.tokens("a", (4,))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            first = received()
            bridge.tokens("c", (5,))
            bridge.send(Load(3, 0.0, 0, 1, 0, 0, 0))  # sent later: after c's tokens
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return first, received()
        finally:
            bridge.close()

    try:
        first, second = asyncio.run(main())
    finally:
        pull.close(0)
        ctx.term()
    assert len(first) == 1 and isinstance(first[0], Tokens)
    assert first[0].worker == 3 and first[0].items == (("a", (1,)), ("b", (2, 3)), ("a", (4,)))
    assert [type(m) for m in second] == [Tokens, Load]  # no empty Tokens after the pass
    assert second[0].items == (("c", (5,)),)
