"""SGLang 0.5.23's generate contract, from the installed package, against our parser.

The spec is SGLang's own: ``sglang.api.v1.api_types.GenerateRequest`` / ``SamplingParams`` (the
schema-generated contract) and ``sglang.srt.managers.io_struct.GenerateReqInput`` (the ~72
fields its server accepts and its clients send). Every field must be known to
``router/protocol`` (a new pin that adds one fails here until it is handled), every field
must be accepted with SGLang's default value, and a set value must be honoured, passed
through untouched on ``--backend sglang``, or refused on the simulated engine with a 400 that
names the field and says why. Unknown top-level keys are ignored; unknown
``sampling_params`` keys are refused, as SGLang's contract says.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("sglang")

from sglang.api.v1 import api_types as A  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402

from sgl_fair.router import protocol as P  # noqa: E402
from sgl_fair.router.protocol.requests_sglang import (  # noqa: E402
    GENERATE_FIELDS,
    GENERATE_REFUSED,
    GENERATE_SIM_REFUSED,
    SAMPLING_FIELDS,
)

IO_FIELDS = [f.name for f in dataclasses.fields(GenerateReqInput)]
API_FIELDS = list(A.GenerateRequest.__struct_fields__)
API_SAMPLING = list(A.SamplingParams.__struct_fields__)
LIMITS = P.Limits(context_len=4096)


# what each backend's engine honours beyond the router's own fields (apps/launch/backends.py)
FEATURES = {"sim": P.NO_PASSTHROUGH, "sglang": P.EngineFeatures(passthrough=True)}


def parse(body: dict, engine: str = "sim") -> P.GenerateRequest:
    return P.parse_generate(json.dumps(body).encode(), LIMITS, FEATURES[engine])


def test_the_pinned_contract_is_the_one_we_know():
    assert len(IO_FIELDS) >= 70 and len(API_FIELDS) >= 35  # the package really was read
    unknown = sorted(set(IO_FIELDS + API_FIELDS) - GENERATE_FIELDS)
    assert not unknown, f"SGLang's generate request has fields router/protocol ignores: {unknown}"
    unknown_sp = sorted(set(API_SAMPLING) - SAMPLING_FIELDS)
    assert not unknown_sp, f"SGLang's sampling_params has keys we refuse: {unknown_sp}"


def _defaults_body() -> dict:
    """What SGLang's own GenerateReqInput serializes to with every field at its default."""
    req = GenerateReqInput(text="hello world", sampling_params={"max_new_tokens": 4})
    body = {f: getattr(req, f) for f in IO_FIELDS}
    return json.loads(json.dumps(body, default=lambda o: None))


@pytest.mark.parametrize("engine", ["sim", "sglang"])
def test_every_field_at_sglang_default_is_accepted(engine):
    body = _defaults_body()
    body["model"] = "anything"  # a gateway adds it
    body["return_routed_experts"] = False  # SGLang 0.5.23's clients send it every time
    req = parse(body, engine)
    assert req.items[0].text == "hello world"
    assert req.items[0].sampling.max_new_tokens == 4
    assert req.items[0].extra is None  # nothing set, nothing passed through


def test_api_types_defaults_are_accepted():
    # the schema-generated contract, every field present with its default
    defaults = A.GenerateRequest(text="hi").to_json_value()
    sp = A.SamplingParams().to_json_value()
    defaults["sampling_params"] = {k: v for k, v in sp.items() if k != "max_new_tokens"}
    for engine in ("sim", "sglang"):
        req = parse(defaults, engine)
        assert req.items[0].sampling.top_k >= 1  # SGLang's "all" default is a big top-k


# A value that sets each field (what a client asking for the feature sends).
SET = {
    "rid": "r1",
    "text": "hi",
    "input_ids": [1, 2],
    "stream": True,
    "sampling_params": {"temperature": 0.5},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
    "return_text_in_logprobs": True,
    "routing_key": "k",
    "return_prompt_token_ids": True,
    "input_embeds": [[0.1, 0.2]],
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
    "decode_tp_size": 2,
    "max_dynamic_patch": 4,
    "min_dynamic_patch": 1,
    "image_max_dynamic_patch": 4,
    "video_max_dynamic_patch": 4,
    "priority": 1,
    "data_parallel_rank": 0,
    "routed_dp_rank": 0,
    "disagg_prefill_dp_rank": 0,
    "max_thinking_tokens": 16,
    "routed_experts_start_len": 1,
    "custom_labels": {"team": "a"},
    "session_params": {"id": "s"},
    "video_config": {"fps": 1},
    "images_config": {"max": 1},
    "mm_processor_kwargs": {"a": 1},
    "external_trace_header": {"traceparent": "x"},
    "watermark": {"enabled": True},
    "kv_hints": {"hints": []},
    "num_items_assigned": {"image": [1]},
    "received_time": 1.5,
    "modalities": ["image"],
    "encoder_urls": ["http://e"],
    "mm_hashes": ["h"],
    "mm_content_hashes": ["h"],
    "multi_item_delimiter_indices": [1],
    "token_indices_to_pool": [1],
    "token_ids_logprob": [1, 2],
    "positional_embed_overrides": {"a": 1},
}


def _set_value(field: str):
    if field in SET:
        return SET[field]
    ann = str(next((f.type for f in dataclasses.fields(GenerateReqInput) if f.name == field), ""))
    if "bool" in ann or field.startswith("return_") or field in ("log_metrics", "no_logs"):
        return True
    return "x"


@pytest.mark.parametrize("field", sorted(set(IO_FIELDS + API_FIELDS)))
def test_every_field_set_is_honoured_passed_through_or_refused_with_a_reason(field):
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    if field not in ("text", "input_ids", "stream"):
        body[field] = _set_value(field)
    if field == "input_ids":
        body = {"input_ids": [1, 2, 3]}
    if field == "stream":
        body["stream"] = True
    if field in GENERATE_REFUSED:  # input_embeds, outputs the router does not relay
        for engine in ("sim", "sglang"):
            with pytest.raises(P.ProtocolError) as e:
                parse(body, engine)
            assert e.value.param == field and "not supported by this server" in e.value.message
        return
    real = parse(body, "sglang")  # SGLang takes every field
    item = real.items[0]
    if field in GENERATE_SIM_REFUSED:
        assert item.extra == {field: body[field]}  # passed through untouched
        with pytest.raises(P.ProtocolError) as e:
            parse(body, "sim")
        assert e.value.status == 400 and e.value.param == field
        assert "not possible on the simulated engine" in e.value.message
    else:
        parse(body, "sim")  # honoured, or accepted without effect


@pytest.mark.parametrize("key", API_SAMPLING)
def test_every_sampling_key_is_known(key):
    sample = {
        "max_new_tokens": 3,
        "stop": ["."],
        "stop_token_ids": [2],
        "stop_regex": ["a+"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "min_new_tokens": 1,
        "n": 2,
        "json_schema": '{"type": "object"}',
        "regex": "a+",
        "ebnf": "root ::= 'a'",
        "structural_tag": '{"type": "structural_tag"}',
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "stream_interval": 2,
        "logit_bias": {"5": -1.0},
        "sampling_seed": 7,
        "custom_params": {"a": 1},
        "beam_width": 2,
        "watermark": {"enabled": True},
        "choice": ["a", "b"],
    }
    assert key in sample, f"new sampling key {key!r}: add it to this test and router/protocol"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, key: sample[key]}}
    sp = parse(body, "sglang").items[0].sampling
    passed = sp.engine_extra or {}
    try:
        parse(body, "sim")
    except P.ProtocolError as e:
        assert e.param == f"sampling_params.{key}" and "not possible" in e.message
        assert passed == {key: sample[key]}  # what the sim refuses, SGLang gets untouched
    else:
        assert key not in passed


def test_unknown_keys_top_level_ignored_sampling_refused():
    req = parse({"text": "hi", "model": "m", "brand_new_field": {"x": 1}})
    assert req.items[0].text == "hi"
    with pytest.raises(P.ProtocolError) as e:
        parse({"text": "hi", "sampling_params": {"bogus": 1}})
    assert e.value.param == "sampling_params.bogus" and "unknown field" in e.value.message


def test_bad_values_of_known_fields_still_name_the_field():
    cases = [
        ({"log_metrics": 1}, "log_metrics"),
        ({"priority": "high"}, "priority"),
        ({"extra_key": 5}, "extra_key"),
        ({"return_prompt_token_ids": "y"}, "return_prompt_token_ids"),
        ({"sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"sampling_params": {"regex": 5}}, "sampling_params.regex"),
        ({"sampling_params": {"beam_width": 0}}, "sampling_params.beam_width"),
    ]
    for extra, param in cases:
        for engine in ("sim", "sglang"):
            with pytest.raises(P.ProtocolError) as e:
                parse({"text": "hi", **extra}, engine)
            assert e.value.status == 400 and e.value.param == param, (extra, engine)


def test_batch_passes_per_prompt_fields_per_prompt():
    req = parse(
        {"text": ["a", "b"], "lora_path": ["l1", None], "custom_logit_processor": "p"}, "sglang"
    )
    assert req.items[0].extra == {"lora_path": "l1", "custom_logit_processor": "p"}
    assert req.items[1].extra == {"custom_logit_processor": "p"}


def test_passthrough_reaches_sglangs_generate_body():
    from sgl_fair.request import Request
    from sgl_fair.router.generation import engine_sampling
    from worker.sglang.http_api import generate_body

    item = parse(
        {
            "text": "hi",
            "lora_path": "adapter",
            "sampling_params": {"max_new_tokens": 3, "regex": "a+", "temperature": 0.5},
        },
        "sglang",
    ).items[0]
    req = Request(
        rid="r",
        client="c",
        input_ids=(1, 2),
        output_len=3,
        arrival_s=0.0,
        max_new_tokens=3,
        sampling=engine_sampling(item.sampling),
        extra=item.extra,
    )
    body = generate_body(req)
    assert body["lora_path"] == "adapter"
    assert body["sampling_params"] == {"temperature": 0.5, "regex": "a+", "max_new_tokens": 3}
    assert body["input_ids"] == [1, 2] and body["stream"] is True


def test_openai_passthrough_on_sglang_and_refusal_on_sim():
    chat = {
        "model": "whatever",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        "lora_path": "adapter",
        "brand_new": 1,
    }
    req = P.parse_chat(json.dumps(chat).encode(), LIMITS, FEATURES["sglang"])
    assert req.item.sampling.engine_extra == {"json_schema": '{"type":"object"}'}
    assert req.item.extra == {"lora_path": "adapter"}
    with pytest.raises(P.ProtocolError) as e:
        P.parse_chat(json.dumps(chat).encode(), LIMITS, FEATURES["sim"])
    assert e.value.param in ("lora_path", "response_format")
    assert "not possible on the simulated engine" in e.value.message


def test_the_bridges_class_and_slo_fields_are_sglangs_own():
    """What the bridge sends for ``bros`` (``priority``, ``custom_params`` with our SLO key)
    is a valid SGLang 0.5.23 request: ``GenerateReqInput`` takes it and ``SamplingParams``
    verifies it, the SLOs kept where the plugin reads them."""
    from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

    from sgl_fair.request import SLO_PARAM, Request, ServiceClass
    from worker.sglang.http_api import generate_body

    req = Request(
        rid="r", client="c", input_ids=(1, 2), output_len=3, arrival_s=0.0, max_new_tokens=3,
        service_class=ServiceClass.RT, ttft_slo_s=0.3,
    )  # fmt: skip
    body = generate_body(req, class_priority=True)
    gen = GenerateReqInput(**body)
    assert gen.priority == 100 and gen.routing_key == "c"
    sp = SglSamplingParams(**body["sampling_params"])
    sp.verify(32000)
    assert sp.custom_params == {SLO_PARAM: [0.3, 0.2]}
