"""SGLang-native ``POST /generate``: the body parsed and validated into a
:class:`GenerateRequest`.

``text`` or ``input_ids``, one prompt or a batch; ``sampling_params`` and the logprob options
once or per prompt. SGLang's fields that change nothing here are accepted and checked; the
features this server does not implement are refused (``requests_common`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_fair.router.protocol.errors import ProtocolError
from sgl_fair.router.protocol.requests_common import (
    _COMMON_SAMPLING,
    DEFAULT_LIMITS,
    GenItem,
    Limits,
    SamplingParams,
    _bad,
    _bool,
    _empty,
    _Fields,
    _include_usage,
    _int,
    _int_v,
    _load_object,
    _num_v,
    _obj,
    _prompts,
    _sampling_from,
    _str,
    _unsupported,
    _v_max_new,
    _v_null_only,
    _v_stream_interval,
)


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
_NATIVE_SAMPLING: _Fields = {
    **_COMMON_SAMPLING,
    "max_new_tokens": ("max_new_tokens", _v_max_new),
    "min_new_tokens": ("min_new_tokens", _int_v(lo=0)),
    "temperature": ("temperature", _num_v(0, 100)),
    "sampling_seed": ("seed", _int_v()),
    "custom_params": (None, _v_null_only),
    "stream_interval": ("stream_interval", _v_stream_interval),
}


def _native_sampling(v: Any, path: str, limits: Limits) -> SamplingParams:
    sp = _obj(v, path)
    for key in sp:
        if key not in _NATIVE_SAMPLING:
            raise ProtocolError(400, f"unknown field {path}.{key}", f"{path}.{key}")
    return _sampling_from(sp, _NATIVE_SAMPLING, path + ".", limits)


# ---- POST /generate -------------------------------------------------------------------------

# Fields accepted and ignored (they change nothing this server does), with their check.
_GENERATE_HARMLESS: dict[str, Any] = {
    "log_metrics": _bool,
    "priority": _int,
    "custom_labels": _obj,
    "data_parallel_rank": _int,
    "extra_key": _str,
    "stream_options": _obj,
}
# Fields that must be null/false/empty: features this server does not implement.
_GENERATE_UNSUPPORTED = {
    "image_data": "image input",
    "video_data": "video input",
    "audio_data": "audio input",
    "input_embeds": "input_embeds",
    "modalities": "modalities",
    "lora_path": "LoRA (lora_path)",
    "lora_id": "LoRA (lora_id)",
    "return_hidden_states": "return_hidden_states",
    "custom_logit_processor": "custom_logit_processor",
    "session_params": "session_params",
    "token_ids_logprob": "token_ids_logprob",
    "bootstrap_host": "disaggregation (bootstrap_host)",
    "bootstrap_port": "disaggregation (bootstrap_port)",
    "bootstrap_room": "disaggregation (bootstrap_room)",
    "bootstrap_pair_key": "disaggregation (bootstrap_pair_key)",
}
_GENERATE_KEYS = frozenset(
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
        *_GENERATE_HARMLESS,
        *_GENERATE_UNSUPPORTED,
    }
)


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


def parse_generate(body: bytes, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    """Parse and validate SGLang's ``POST /generate`` body.

    Exactly one of ``text`` (a string or a non-empty list of strings) and ``input_ids``
    (ids or a non-empty list of id lists). ``sampling_params``, ``return_logprob``,
    ``logprob_start_len`` and ``top_logprobs_num`` may be given once or, for a batch, as
    a list with one per prompt. Streaming a batch is refused (we stream one request per
    HTTP response). Token ids are checked for being >= 0 here and against the vocabulary
    by the server (:func:`check_ids`), which knows the tokenizer.
    """
    obj = _load_object(body)
    for key in obj:
        if key not in _GENERATE_KEYS:
            raise ProtocolError(400, f"unknown field {key!r}", key)
    for key, what in _GENERATE_UNSUPPORTED.items():
        if not _empty(obj.get(key)):
            raise _unsupported(key, what)
    for key, check in _GENERATE_HARMLESS.items():
        if obj.get(key) is not None:
            check(obj[key], key)

    text, input_ids = obj.get("text"), obj.get("input_ids")
    if text is None and input_ids is None:
        raise ProtocolError(400, "one of text or input_ids is required", "text")
    if text is not None and input_ids is not None:
        raise ProtocolError(400, "give either text or input_ids, not both", "input_ids")
    if text is not None:
        prompts, are_ids, is_batch = _prompts(
            text, "text", limits, allow_text=True, allow_ids=False
        )
    else:
        prompts, are_ids, is_batch = _prompts(
            input_ids, "input_ids", limits, allow_text=False, allow_ids=True
        )
    n = len(prompts)

    stream = obj.get("stream")
    stream = False if stream is None else _bool(stream, "stream")
    if stream and is_batch:
        raise ProtocolError(
            400,
            "streaming is not supported for batch requests: send one prompt per request",
            "stream",
        )

    sp = obj.get("sampling_params")
    if sp is None:
        samplings = [SamplingParams()] * n
    else:
        samplings = _per_item(
            sp, "sampling_params", n, is_batch, lambda v, p: _native_sampling(v, p, limits)
        )

    def opt(key: str, default: Any, check: Any) -> list[Any]:
        v = obj.get(key)
        return [default] * n if v is None else _per_item(v, key, n, is_batch, check)

    return_logprob = opt("return_logprob", False, _bool)
    start_lens = opt("logprob_start_len", -1, lambda v, p: _int(v, p, lo=-1))
    top_nums = opt("top_logprobs_num", 0, lambda v, p: _int(v, p, 0, limits.max_top_logprobs))
    text_in_lp = obj.get("return_text_in_logprobs")
    text_in_lp = False if text_in_lp is None else _bool(text_in_lp, "return_text_in_logprobs")

    rid = obj.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * n
    elif is_batch:
        if type(rid) is not list or len(rid) != n:
            raise _bad("rid", f"a list of {n} strings (one per prompt)", rid)
        rids = [_str(r, f"rid[{i}]", nonempty=True) for i, r in enumerate(rid)]
        if len(set(rids)) != n:
            raise ProtocolError(400, "rid has duplicate entries", "rid")
    else:
        rids = [_str(rid, "rid", nonempty=True)]
    routing_key = obj.get("routing_key")
    if routing_key is not None:
        _str(routing_key, "routing_key")

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
        )
        for i in range(n)
    ]
    return GenerateRequest(
        items=items,
        is_batch=is_batch,
        stream=stream,
        include_usage=_include_usage(obj),
        priority=obj.get("priority"),
        custom_labels=obj.get("custom_labels"),
    )
