"""Property-based HTTP fuzz of the live server: bodies built from the request schemas (known
fields with any values, unknown fields, wrong types, junk) never get a 5xx and never hang.

Every answer is either a success or a 4xx whose JSON names the problem; after the run the
server is healthy and holds no request.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_helpers import launched

pytestmark = pytest.mark.slow

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=30),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
SAMPLING_KEYS = [
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "n", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "skip_special_tokens", "stream_interval", "json_schema", "regex",
]  # fmt: skip
NATIVE_KEYS = [
    "text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "routing_key", "model", "lora_path",
]  # fmt: skip
OPENAI_KEYS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stop",
    "stream", "stream_options", "logprobs", "top_logprobs", "temperature", "user", "seed",
    "response_format", "echo", "suffix", "best_of", "tools",
]  # fmt: skip


def plausible(key: str) -> st.SearchStrategy:
    """Values near what the field takes, so the fuzz reaches past the first type check."""
    if key in ("text", "prompt", "rid", "user", "routing_key", "model"):
        return st.one_of(st.text(max_size=40), JUNK)
    if key in ("input_ids", "stop_token_ids"):
        return st.one_of(st.lists(st.integers(-5, 40_000), max_size=20), JUNK)
    if key in ("max_new_tokens", "max_tokens", "max_completion_tokens", "n", "top_k"):
        return st.one_of(st.integers(-3, 300), JUNK)
    if key == "messages":
        role = st.sampled_from(["user", "system", "assistant", "tool", "x"])
        content = st.one_of(st.text(max_size=20), st.lists(JUNK, max_size=2), JUNK)
        msg = st.fixed_dictionaries({"role": role, "content": content})
        return st.one_of(st.lists(msg, max_size=3), JUNK)
    if key == "sampling_params":
        keys = st.sampled_from([*SAMPLING_KEYS, "bogus"])
        return st.one_of(st.dictionaries(keys, st.deferred(lambda: SCALARS), max_size=5), JUNK)
    return JUNK


def body_for(keys: list[str]) -> st.SearchStrategy:
    fields = st.lists(st.sampled_from([*keys, "unknown_field"]), unique=True, max_size=6)
    return fields.flatmap(lambda names: st.fixed_dictionaries({k: plausible(k) for k in names}))


REQUESTS = st.one_of(
    st.tuples(st.just("/generate"), body_for(NATIVE_KEYS)),
    st.tuples(st.just("/v1/completions"), body_for(OPENAI_KEYS)),
    st.tuples(st.just("/v1/chat/completions"), body_for(OPENAI_KEYS)),
    st.tuples(st.sampled_from(["/generate", "/v1/completions"]), JUNK),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    args = ("--dp", "2", "--time-scale", "inf", "--context-length", "2048")
    with launched(*args, tmp_path=tmp) as s:
        yield s


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(REQUESTS)
def test_fuzzed_requests_get_no_5xx(server, request_):
    path, body = request_
    data = json.dumps(body).encode()
    r = httpx.post(
        server.url + path, content=data, headers={"Content-Type": "application/json"},
        timeout=30,
    )  # fmt: skip
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text


def test_the_server_is_healthy_after_the_fuzz(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.info()["in_flight"] == 0
