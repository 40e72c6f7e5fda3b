"""SGLang-native ``POST /generate``: the body parsed and validated into a
:class:`GenerateRequest`.

``text`` or ``input_ids``, one prompt or a batch; ``sampling_params`` and the logprob options
once or per prompt. Every field of SGLang 0.5.23's generate request is known here
(``GENERATE_FIELDS``): honoured, accepted without effect, passed through to SGLang on
``--backend sglang``, or refused on the simulated engine with the reason
(``docs/compatibility.md`` has the table). Unknown top-level fields are ignored, as SGLang
ignores them; unknown ``sampling_params`` keys are refused, as SGLang refuses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sgl_fair.request import INFLIGHT_PARAM, SLO_PARAM
from sgl_fair.router.protocol.errors import ProtocolError
from sgl_fair.router.protocol.fields import (
    FieldTable,
    PassThrough,
    bad_value,
    check_bool,
    check_int,
    check_obj,
    check_str,
    is_empty,
    load_object,
    v_int,
    v_max_new,
    v_num,
    v_obj,
    v_str_list,
    v_stream_interval,
)
from sgl_fair.router.protocol.requests_common import (
    COMMON_SAMPLING,
    DEFAULT_LIMITS,
    NO_PASSTHROUGH,
    EngineFeatures,
    GenItem,
    Limits,
    SamplingParams,
    include_usage,
    parse_prompts,
    sampling_from,
    sim_refusal,
)
from sgl_fair.router.protocol.scheduling import SCHEDULING_FIELDS, Hints, check_slo, parse_hints


@dataclass(slots=True)
class GenerateRequest:
    """``POST /generate``: ``is_batch`` when ``text``/``input_ids`` was a list (the response
    is then a JSON list, one object per item)."""

    items: list[GenItem]
    is_batch: bool
    stream: bool = False
    include_usage: bool = False
    priority: int | None = None
    custom_labels: dict[str, str] | None = None


# SGLang's sampling_params object (POST /generate).
_NATIVE_SAMPLING: FieldTable = {
    **COMMON_SAMPLING,
    "max_new_tokens": ("max_new_tokens", v_max_new),
    "min_new_tokens": ("min_new_tokens", v_int(lo=0)),
    "temperature": ("temperature", v_num(0, 100)),
    "sampling_seed": ("seed", v_int()),
    "stream_interval": ("stream_interval", v_stream_interval),
    "custom_params": PassThrough("custom_params (for a custom logit processor)", v_obj),
    "beam_width": PassThrough("beam search", v_int(lo=1)),
    "watermark": PassThrough("watermarking (it changes the sampler)", v_obj),
    "choice": PassThrough("constrained decoding (choice)", v_str_list),
}


def _take_our_params(v: Any, path: str) -> tuple[Any, tuple[float, float] | None]:
    """``sampling_params`` without our SLO key in ``custom_params`` (``SLO_PARAM``: what an
    sgl-fair bridge in front of this server sends, as it does to SGLang), and the SLOs; a
    bridge's ``INFLIGHT_PARAM`` is dropped (this server's router counts its own calls)."""
    params = v.get("custom_params") if isinstance(v, dict) else None
    if isinstance(params, dict) and INFLIGHT_PARAM in params:  # a bridge's count: this
        params = {k: x for k, x in params.items() if k != INFLIGHT_PARAM}  # router counts its own
        v = {k: x for k, x in v.items() if k != "custom_params"}
        if params:
            v["custom_params"] = params
    if not isinstance(params, dict) or SLO_PARAM not in params:
        return v, None
    where = f"{path}.custom_params.{SLO_PARAM}"
    value = params[SLO_PARAM]
    if not isinstance(value, list) or len(value) != 2:
        raise bad_value(where, "[ttft_slo_s, tpot_slo_s]", value)
    slo = (check_slo(value[0], where + "[0]"), check_slo(value[1], where + "[1]"))
    rest = {k: x for k, x in params.items() if k != SLO_PARAM}
    v = {k: x for k, x in v.items() if k != "custom_params"}
    if rest:
        v["custom_params"] = rest
    return v, slo


def _with_slo(hints: Hints | None, slo: tuple[float, float] | None) -> Hints | None:
    """The body's own ``ttft_slo_s`` / ``tpot_slo_s`` win over ``custom_params``'."""
    if slo is None:
        return hints
    hints = hints or Hints()
    return dataclasses.replace(
        hints,
        ttft_slo_s=slo[0] if hints.ttft_slo_s is None else hints.ttft_slo_s,
        tpot_slo_s=slo[1] if hints.tpot_slo_s is None else hints.tpot_slo_s,
    )


def _native_sampling(v: Any, path: str, limits: Limits, features: EngineFeatures) -> SamplingParams:
    sp = check_obj(v, path)
    for key in sp:
        if key not in _NATIVE_SAMPLING:
            raise ProtocolError(400, f"unknown field {path}.{key}", f"{path}.{key}")
    params = sampling_from(sp, _NATIVE_SAMPLING, path + ".", limits, features)
    if params.n > 1 and params.engine_extra and "beam_width" in params.engine_extra:
        raise ProtocolError(400, f"{path}.n: give n or beam_width, not both", f"{path}.n")
    return params


# ---- POST /generate -------------------------------------------------------------------------
# Every field of SGLang 0.5.23's generate request (``GenerateReqInput`` in
# sglang/srt/managers/io_struct.py and ``sglang.api.v1.GenerateRequest``), by what we do with
# it. Fields parsed by ``parse_generate`` itself are in _GENERATE_OWN. Unknown fields are
# ignored, as SGLang ignores them.

_GENERATE_OWN = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "rid",
        "routing_key",
        "return_prompt_token_ids",
        "stream_options",
    }
)


def _opt_int(v: Any, path: str) -> Any:
    return check_int(v, path)


def _str_or_list(v: Any, path: str) -> Any:
    if type(v) is str:
        return v
    if type(v) is not list or any(x is not None and type(x) is not str for x in v):
        raise bad_value(path, "a string or a list of strings", v)
    return v


def _any(v: Any, path: str) -> Any:
    return v


# Accepted, and changes nothing here: logging and tracing, the engine's internal
# bookkeeping, data-parallel placement (our router places requests), hints. Value checked.
_GENERATE_IGNORED: dict[str, Any] = {
    "log_metrics": check_bool,
    "no_logs": check_bool,
    "priority": check_int,
    "custom_labels": check_obj,
    "data_parallel_rank": _opt_int,
    "routed_dp_rank": _opt_int,
    "disagg_prefill_dp_rank": _opt_int,
    "session_id": check_str,
    "conversation_id": check_str,
    "background": check_bool,
    "http_worker_ipc": check_str,
    "received_time": _any,
    "external_trace_header": check_obj,
    "need_wait_for_mm_inputs": check_bool,
    "num_items_assigned": _any,
    "kv_hints": _any,
    "require_reasoning": check_bool,
    "max_thinking_tokens": lambda v, p: check_int(v, p, lo=0),
    "routed_experts_start_len": lambda v, p: check_int(v, p, lo=0),
}
# Passed through to SGLang on --backend sglang; on the simulated engine accepted with no
# effect (they only partition a prefix cache or pin a disaggregated peer).
_GENERATE_FORWARD: dict[str, Any] = {
    "extra_key": _str_or_list,
    "cache_salt": _str_or_list,
    "decode_tp_size": _any,
}
# Passed through to SGLang on --backend sglang; on the simulated engine refused when set
# (anything but null/false/empty), with the reason.
GENERATE_SIM_REFUSED: dict[str, str] = {
    "image_data": "image input (the simulated engine is a text model)",
    "video_data": "video input (the simulated engine is a text model)",
    "audio_data": "audio input (the simulated engine is a text model)",
    "mm_hashes": "multimodal input",
    "mm_content_hashes": "multimodal input",
    "use_audio_in_video": "multimodal input",
    "video_config": "multimodal input",
    "images_config": "multimodal input",
    "mm_processor_kwargs": "multimodal input",
    "max_dynamic_patch": "multimodal input",
    "min_dynamic_patch": "multimodal input",
    "image_max_dynamic_patch": "multimodal input",
    "video_max_dynamic_patch": "multimodal input",
    "encoder_urls": "multimodal input (encoder_urls)",
    "modalities": "multimodal input (modalities)",
    "positional_embed_overrides": "positional_embed_overrides",
    "multi_item_delimiter_indices": "multi-item scoring",
    "token_indices_to_pool": "pooling",
    "lora_path": "LoRA (lora_path)",
    "lora_id": "LoRA (lora_id)",
    "custom_logit_processor": "a custom logit processor",
    "session_params": "sessions (session_params)",
    "watermark": "watermarking",
    "sampling_logprobs_mode": "sampling_logprobs_mode",
    "bootstrap_host": "disaggregation (bootstrap_host)",
    "bootstrap_port": "disaggregation (bootstrap_port)",
    "bootstrap_room": "disaggregation (bootstrap_room)",
    "bootstrap_pair_key": "disaggregation (bootstrap_pair_key)",
}
# Refused on every backend, set: the router must see the prompt's tokens to route and count
# it, and it relays SGLang's tokens, text, logprobs and finish reason, not the engine's
# internals (a pass-through would silently drop what they ask for).
NOT_RELAYED = (
    "is not supported by this server: it relays SGLang's tokens, text and logprobs, not the "
    "engine's internals"
)
GENERATE_REFUSED = {
    "input_embeds": "is not supported by this server: the router needs the prompt's tokens",
    **dict.fromkeys(
        [
            "token_ids_logprob",
            "return_sampling_mask",
            "return_hidden_states",
            "return_routed_experts",
            "return_indexer_topk",
            "return_entropy",
            "return_bytes",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs",
            "return_flat_raw_top_logprobs_b64",
        ],
        NOT_RELAYED,
    ),
}

# Every top-level field we know, for the contract test and the docs.
GENERATE_FIELDS = frozenset(
    {
        *_GENERATE_OWN,
        *_GENERATE_IGNORED,
        *_GENERATE_FORWARD,
        *GENERATE_SIM_REFUSED,
        *GENERATE_REFUSED,
        *SCHEDULING_FIELDS,
    }
)
SAMPLING_FIELDS = frozenset(_NATIVE_SAMPLING)
# Per-prompt fields that a batch may give as a list with one entry per prompt.
_PER_PROMPT = frozenset(
    {
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "image_data",
        "video_data",
        "audio_data",
        "mm_hashes",
        "mm_content_hashes",
        "sampling_logprobs_mode",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "extra_key",
        "cache_salt",
        "kv_hints",
    }
)


def _passthrough(
    obj: dict[str, Any], features: EngineFeatures, n: int, is_batch: bool
) -> list[dict[str, Any] | None]:
    """The top-level fields each prompt passes through to the engine (``features``
    ``passthrough``: SGLang); without passthrough, a 400 for any that cannot be honoured."""
    for key, why in GENERATE_REFUSED.items():
        v = obj.get(key)
        if not is_empty(v) and not (type(v) is list and all(is_empty(x) for x in v)):
            raise ProtocolError(400, f"{key} {why}", key)
    for key, check in _GENERATE_IGNORED.items():
        if obj.get(key) is not None:
            check(obj[key], key)
    for key, check in _GENERATE_FORWARD.items():
        if obj.get(key) is not None:
            check(obj[key], key)
    if not features.passthrough:
        for key, why in GENERATE_SIM_REFUSED.items():
            v = obj.get(key)
            if key == "modalities" and v in (["text"], ("text",)):
                continue  # text only: what the simulated engine is
            if not is_empty(v) and not (type(v) is list and all(is_empty(x) for x in v)):
                raise sim_refusal(key, why)
        return [None] * n
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for key in (*_GENERATE_FORWARD, *GENERATE_SIM_REFUSED):
        v = obj.get(key)
        if is_empty(v):
            continue
        if is_batch and key in _PER_PROMPT and type(v) is list and len(v) == n:
            for i in range(n):
                if v[i] is not None:
                    out[i][key] = v[i]
        else:
            for d in out:
                d[key] = v
    return [d or None for d in out]


def _per_item(v: Any, path: str, n: int, is_batch: bool, check: Any) -> list[Any]:
    """A value given once for all items, or (batch only) as a list with one per item."""
    if type(v) is list:
        if not is_batch or len(v) != n:
            raise ProtocolError(
                400,
                f"{path} is a list of {len(v)}; it must be a single value"
                + (f" or a list of {n} (one per prompt)" if is_batch else ""),
                path,
            )
        return [check(x, f"{path}[{i}]") for i, x in enumerate(v)]
    return [check(v, path)] * n


def parse_generate(
    body: bytes, limits: Limits = DEFAULT_LIMITS, features: EngineFeatures = NO_PASSTHROUGH
) -> GenerateRequest:
    """Parse and validate SGLang's ``POST /generate`` body.

    Exactly one of ``text`` (a string or a non-empty list of strings) and ``input_ids``
    (ids or a non-empty list of id lists). ``sampling_params``, ``return_logprob``,
    ``logprob_start_len`` and ``top_logprobs_num`` may be given once or, for a batch, as
    a list with one per prompt. Streaming a batch is refused (we stream one request per
    HTTP response). Token ids are checked for being >= 0 here and against the vocabulary
    by the server (:func:`check_ids`), which knows the tokenizer.

    Unknown top-level fields are ignored (SGLang's contract); ``features`` is what the
    workers' engine honours: what only a real engine can is passed through when it has
    ``passthrough`` (SGLang: ``GenItem.extra``, ``SamplingParams.engine_extra``) and refused
    otherwise. ``sampling_params.n`` > 1 asks for that many samples of each prompt.
    """
    obj = load_object(body)

    text, input_ids = obj.get("text"), obj.get("input_ids")
    if text is None and input_ids is None:
        raise ProtocolError(400, "one of text or input_ids is required", "text")
    if text is not None and input_ids is not None:
        raise ProtocolError(400, "give either text or input_ids, not both", "input_ids")
    if text is not None:
        prompts, are_ids, is_batch = parse_prompts(
            text, "text", limits, allow_text=True, allow_ids=False
        )
    else:
        prompts, are_ids, is_batch = parse_prompts(
            input_ids, "input_ids", limits, allow_text=False, allow_ids=True
        )
    n = len(prompts)

    stream = obj.get("stream")
    stream = False if stream is None else check_bool(stream, "stream")
    if stream and is_batch:
        raise ProtocolError(
            400,
            "streaming is not supported for batch requests: send one prompt per request",
            "stream",
        )

    sp = obj.get("sampling_params")
    slos: list[tuple[float, float] | None] = [None] * n
    if sp is None:
        samplings = [SamplingParams()] * n
    else:

        def native(v: Any, p: str) -> tuple[SamplingParams, tuple[float, float] | None]:
            v, slo = _take_our_params(v, p)
            return _native_sampling(v, p, limits, features), slo

        pairs = _per_item(sp, "sampling_params", n, is_batch, native)
        samplings, slos = [s for s, _ in pairs], [slo for _, slo in pairs]
    extras = _passthrough(obj, features, n, is_batch)

    def opt(key: str, default: Any, check: Any) -> list[Any]:
        v = obj.get(key)
        return [default] * n if v is None else _per_item(v, key, n, is_batch, check)

    return_logprob = opt("return_logprob", False, check_bool)
    start_lens = opt("logprob_start_len", -1, lambda v, p: check_int(v, p, lo=-1))
    top_nums = opt("top_logprobs_num", 0, lambda v, p: check_int(v, p, 0, limits.max_top_logprobs))
    text_in_lp = obj.get("return_text_in_logprobs")
    text_in_lp = False if text_in_lp is None else check_bool(text_in_lp, "return_text_in_logprobs")
    prompt_ids = obj.get("return_prompt_token_ids")
    prompt_ids = False if prompt_ids is None else check_bool(prompt_ids, "return_prompt_token_ids")

    rid = obj.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * n
    elif is_batch:
        if type(rid) is not list or len(rid) != n:
            raise bad_value("rid", f"a list of {n} strings (one per prompt)", rid)
        rids = [check_str(r, f"rid[{i}]", nonempty=True) for i, r in enumerate(rid)]
        if len(set(rids)) != n:
            raise ProtocolError(400, "rid has duplicate entries", "rid")
    else:
        rids = [check_str(rid, "rid", nonempty=True)]
    routing_key = obj.get("routing_key")
    if routing_key is not None:
        check_str(routing_key, "routing_key")
    if obj.get("stream_options") is not None:
        check_obj(obj["stream_options"], "stream_options")
    hints = parse_hints(obj)

    items = [
        GenItem(
            text=None if are_ids else prompts[i],  # type: ignore[arg-type]
            input_ids=prompts[i] if are_ids else None,  # type: ignore[arg-type]
            sampling=samplings[i],
            return_logprob=return_logprob[i],
            logprob_start_len=start_lens[i],
            top_logprobs_num=top_nums[i],
            return_text_in_logprobs=text_in_lp,
            rid=rids[i],
            routing_key=routing_key,
            extra=extras[i],
            return_prompt_token_ids=prompt_ids,
            hints=_with_slo(hints, slos[i]),
        )
        for i in range(n)
    ]
    return GenerateRequest(
        items=items,
        is_batch=is_batch,
        stream=stream,
        include_usage=include_usage(obj),
        priority=obj.get("priority"),
        custom_labels=obj.get("custom_labels"),
    )
