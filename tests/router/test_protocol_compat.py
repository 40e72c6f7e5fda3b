"""The SGLang-compatibility rules of ``router/protocol`` without a server (issue 19): unknown
fields, any model name, ``n`` parallel samples and their responses, pass-through vs refusal."""

from __future__ import annotations

import json

import pytest

from sgl_fair.router import protocol as P
from sgl_fair.router.generation import engine_sampling, expand_samples
from sgl_fair.router.tokenizer import BuiltinTokenizer

LIMITS = P.Limits(context_len=4096)


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def test_unknown_top_level_fields_are_ignored_everywhere():
    P.parse_generate(j({"text": "hi", "model": "gw", "return_routed_experts": False, "zz": 1}))
    P.parse_completion(j({"model": "any/name", "prompt": "hi", "brand_new": [1]}))
    req = P.parse_chat(
        j({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "x": {}})
    )
    assert req.model == "gpt-4o"  # the route answers with the served name


def test_unknown_sampling_keys_and_bad_values_still_refused():
    for body, param in [
        ({"text": "hi", "sampling_params": {"nope": 1}}, "sampling_params.nope"),
        ({"text": "hi", "sampling_params": {"n": 65}}, "sampling_params.n"),
        ({"text": "hi", "sampling_params": {"n": True}}, "sampling_params.n"),
        ({"text": "hi", "extra_key": 3}, "extra_key"),
        ({"text": "hi", "custom_labels": [1]}, "custom_labels"),
    ]:
        with pytest.raises(P.ProtocolError) as e:
            P.parse_generate(j(body), LIMITS)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(P.ProtocolError) as e:
        P.parse_completion(j({"model": "m", "prompt": "a", "n": -1}))
    assert e.value.param == "n"


def test_n_expands_to_samples_with_their_own_rids():
    req = P.parse_generate(j({"text": "hi", "rid": "r", "sampling_params": {"n": 3}}), LIMITS)
    items = expand_samples(req.items)
    assert [it.rid for it in items] == ["r", "r-1", "r-2"]
    assert all(it.text == "hi" for it in items)
    cmpl = P.parse_completion(j({"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 2}))
    assert [it.text for it in expand_samples(cmpl.items)] == ["a", "a", "b", "b"]


def test_passthrough_only_on_sglang():
    body = j({"text": "hi", "sampling_params": {"json_schema": "{}", "logit_bias": {"1": 2}}})
    sp = P.parse_generate(body, LIMITS, P.EngineFeatures(passthrough=True)).items[0].sampling
    assert engine_sampling(sp) == {"json_schema": "{}", "logit_bias": {"1": 2}}
    with pytest.raises(P.ProtocolError) as e:
        P.parse_generate(body, LIMITS, P.NO_PASSTHROUGH)
    assert "not possible on the simulated engine" in e.value.message
    # null / false / empty mean "not set" on both
    P.parse_generate(j({"text": "hi", "lora_path": None, "image_data": [], "regex": None}))


def _c(rid, prompt, out, text):
    return P.Completion(
        rid=rid, prompt_ids=prompt, output_ids=out, text=text, finish=P.FinishInfo("length")
    )


def test_responses_for_n_samples_count_the_prompt_once():
    tok = BuiltinTokenizer()
    cs = [_c("a", [1, 2, 3], [7, 8], "x"), _c("b", [1, 2, 3], [9], "y")]
    chat = P.chat_response(cs, model="served", created=0, tokenizer=tok)
    assert [ch["index"] for ch in chat["choices"]] == [0, 1]
    assert chat["usage"]["prompt_tokens"] == 3 and chat["usage"]["completion_tokens"] == 3
    assert chat["model"] == "served"
    cmpl = P.completion_response(cs, model="served", created=0, tokenizer=tok, n=2)
    assert cmpl["usage"]["prompt_tokens"] == 3 and len(cmpl["choices"]) == 2


def test_an_empty_content_parts_list_is_refused_naming_the_field():
    body = b'{"model": "x", "messages": [{"role": "user", "content": []}]}'
    with pytest.raises(P.ProtocolError) as e:
        P.parse_chat(body, P.DEFAULT_LIMITS)
    assert e.value.status == 400 and e.value.param == "messages[0].content"
