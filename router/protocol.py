"""Request parsing/validation and response building for the HTTP front (pure functions).

The server (Starlette) hands raw body bytes to ``parse_generate`` (SGLang-native
``POST /generate``), ``parse_completion`` (``POST /v1/completions``) or ``parse_chat``
(``POST /v1/chat/completions``) and gets back normalized :class:`GenItem` s, one per
prompt, whatever the wire shape was. Every validation failure raises
:class:`ProtocolError`, whose ``body()`` is OpenAI's error JSON; messages name the
offending field with a JSON path (``sampling_params.max_new_tokens must be an integer >= 0
(got -5)``), because the person reading the 400 is debugging a client.

We are strict on purpose: an unknown field is a 400 naming it (SGLang would answer 422;
silently ignoring it hides typos such as ``max_token``), and features this server does
not implement (constrained decoding, images, LoRA, tools) are refused with a 400 that
says so, never silently dropped. ``null`` always means "not given": SGLang's own
frontend sends ``"regex": null`` and ``"json_schema": null`` with every request.

The builders turn a finished (or in-progress) :class:`Completion` into SGLang's
``/generate`` JSON or OpenAI's shapes; timing and usage come in as arguments, so
everything here is deterministic and testable without a server.

Pure: no network, no torch, no sglang.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from sgl_fair.router.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from sgl_fair.router.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_LIMITS",
    "SSE_DONE",
    "ChatRequest",
    "Completion",
    "CompletionRequest",
    "FinishInfo",
    "GenItem",
    "GenerateRequest",
    "Limits",
    "ProtocolError",
    "SamplingParams",
    "chat_chunk",
    "chat_first_chunk",
    "chat_logprobs",
    "chat_response",
    "chat_usage_chunk",
    "check_ids",
    "check_logprob_start_len",
    "check_prompt_length",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "completion_usage_chunk",
    "error_type",
    "finish_error",
    "generate_chunk",
    "generate_response",
    "model_info",
    "models_response",
    "parse_chat",
    "parse_completion",
    "parse_generate",
    "render_chat_prompt",
    "server_info",
    "sse",
    "sse_error",
    "usage",
]

# ---- errors ---------------------------------------------------------------------------------

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
]


def error_type(status: int) -> ErrorType:
    """OpenAI's error ``type`` for an HTTP status (clients branch on it, e.g. retry on 429)."""
    if status >= 500:
        return "server_error"
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error")


class ProtocolError(Exception):
    """A request the server answers with ``status`` and OpenAI's error body.

    ``param`` is the JSON path of the offending field (``messages[1].content``), or None
    when the problem is not one field (a body that is not JSON). ``retry_after_s`` (for a
    429 or 503) becomes a ``Retry-After`` header via :meth:`headers`.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds, rounded up (HTTP has no fractions), if set."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    @property
    def type(self) -> ErrorType:
        return error_type(self.status)

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def body(self) -> bytes:
        return msgspec.json.encode(self.to_dict())

    def __repr__(self) -> str:
        return f"ProtocolError({self.status}, {self.message!r}, param={self.param!r})"


# ---- limits and normalized requests ---------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Server-wide request limits. ``max_new_tokens_cap`` None means ``context_len``."""

    context_len: int = 8192
    max_new_tokens_cap: int | None = None
    max_batch: int = 256
    max_stop: int = 16
    max_top_logprobs: int = 20

    @property
    def new_tokens_cap(self) -> int:
        return self.context_len if self.max_new_tokens_cap is None else self.max_new_tokens_cap


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters after validation, SGLang's names and defaults.

    Frozen because one instance is shared by every item of a batch that gave it once;
    derive a changed copy with ``dataclasses.replace`` (e.g. after
    :func:`check_prompt_length` clips ``max_new_tokens``).

    ``top_k = -1`` means no top-k (0 is accepted on the wire as the same).
    ``seed`` is OpenAI's ``seed`` / SGLang's ``sampling_seed``.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    stream_interval: int = 1  # stream a chunk every this many tokens (SGLang's name)


@dataclass(slots=True)
class GenItem:
    """One prompt to generate from: exactly one of ``text`` / ``input_ids`` is set (for a
    chat request ``text`` is None until :func:`render_chat_prompt`).

    ``logprob_start_len`` follows SGLang: input (prompt) logprobs are returned for prompt
    positions ``logprob_start_len .. len(prompt) - 1``; ``-1`` (the default) means none,
    only output logprobs (what SGLang's scheduler does for -1 since 0.4.x; older versions
    returned one entry for the last prompt token).
    """

    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | None = None
    routing_key: str | None = None


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


@dataclass(slots=True)
class CompletionRequest:
    """``POST /v1/completions``. ``logprobs`` is OpenAI's integer (None = no logprobs)."""

    model: str
    items: list[GenItem]
    is_batch: bool
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    user: str | None = None


@dataclass(slots=True)
class ChatRequest:
    """``POST /v1/chat/completions``. ``messages`` are ``{"role", "content"}`` with the
    content parts joined; ``item.text`` is None until :func:`render_chat_prompt`."""

    model: str
    messages: list[dict[str, str]]
    item: GenItem
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    user: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final_message: bool = False

    def item_for(self, text: str) -> GenItem:
        """The request's item with its prompt text (from :func:`render_chat_prompt`) set."""
        return replace(self.item, text=text)


# ---- value checks ---------------------------------------------------------------------------


def _show(value: Any) -> str:
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(path: str, what: str, value: Any) -> ProtocolError:
    return ProtocolError(400, f"{path} must be {what} (got {_show(value)})", path)


def _unsupported(path: str, what: str | None = None) -> ProtocolError:
    return ProtocolError(400, f"{what or path} is not supported by this server", path)


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass, and true is not a token count


def _is_num(v: Any) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"<= {hi:g}"


def _int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        what = "an integer" if lo is None and hi is None else f"an integer {_range_text(lo, hi)}"
        raise _bad(path, what, v)
    return v


def _num(v: Any, path: str, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
    ok = _is_num(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        raise _bad(path, f"a number {_range_text(lo, hi, lo_open)}", v)
    return float(v)


def _bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise _bad(path, "a boolean", v)
    return v


def _str(v: Any, path: str, *, nonempty: bool = False) -> str:
    if type(v) is not str or (nonempty and not v):
        raise _bad(path, "a non-empty string" if nonempty else "a string", v)
    return v


def _obj(v: Any, path: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise _bad(path, "an object", v)
    return v


def _empty(v: Any) -> bool:
    """``null``, ``false``, ``""``, ``[]`` and ``{}`` all mean "not used"."""
    return v is None or v is False or (isinstance(v, (str, list, dict)) and not v)


def _load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(400, f"request body is not valid JSON: {e}") from None
    if type(obj) is not dict:
        raise ProtocolError(400, f"request body must be a JSON object (got {_show(obj)})")
    return obj


def _int_list(v: Any, path: str) -> list[int]:
    """A list of token ids (ints >= 0); the per-element loop runs only to name a bad one."""
    if type(v) is not list:
        raise _bad(path, "a list of token ids", v)
    if v and (set(map(type, v)) != {int} or min(v) < 0):
        for i, x in enumerate(v):
            _int(x, f"{path}[{i}]", lo=0)
    return v


def _stop(v: Any, path: str, limits: Limits) -> tuple[str, ...]:
    stops = [v] if type(v) is str else v
    if type(stops) is not list:
        raise _bad(path, "a string or a list of strings", v)
    if len(stops) > limits.max_stop:
        raise ProtocolError(
            400, f"{path} has {len(stops)} entries; at most {limits.max_stop} are allowed", path
        )
    for i, s in enumerate(stops):
        _str(s, path if type(v) is str else f"{path}[{i}]", nonempty=True)
    return tuple(stops)


# ---- sampling parameters: one table per wire format -----------------------------------------

_CONSTRAINED = "constrained decoding is not supported by this server"


def _v_max_new(v: Any, path: str, limits: Limits) -> int:
    n = _int(v, path, lo=0)
    if n > limits.new_tokens_cap:
        raise ProtocolError(400, f"{path} must be <= {limits.new_tokens_cap} (got {n})", path)
    return n


def _v_top_k(v: Any, path: str, limits: Limits) -> int:
    if not _is_int(v) or (v < 1 and v not in (-1, 0)):
        raise _bad(path, "-1 or 0 (disabled) or an integer >= 1", v)
    return -1 if v == 0 else v


def _v_n(v: Any, path: str, limits: Limits) -> None:
    if v != 1 or not _is_int(v):
        raise ProtocolError(400, f"{path} must be 1: this server returns one choice", path)


def _v_constrained(v: Any, path: str, limits: Limits) -> None:
    if not _empty(v):
        raise ProtocolError(400, f"{path}: {_CONSTRAINED}", path)


def _v_null_only(v: Any, path: str, limits: Limits) -> None:
    if not _empty(v):
        raise _unsupported(path)


def _v_stream_interval(v: Any, path: str, limits: Limits) -> int:
    return _int(v, path, lo=1)


def _num_v(lo: float, hi: float | None, lo_open: bool = False):
    return lambda v, path, limits: _num(v, path, lo, hi, lo_open)


def _int_v(lo: int | None = None, hi: int | None = None):
    return lambda v, path, limits: _int(v, path, lo, hi)


def _bool_v(v: Any, path: str, limits: Limits) -> bool:
    return _bool(v, path)


def _stop_v(v: Any, path: str, limits: Limits) -> tuple[str, ...]:
    return _stop(v, path, limits)


def _ids_v(v: Any, path: str, limits: Limits) -> tuple[int, ...]:
    return tuple(_int_list(v, path))


# wire key -> (SamplingParams field or None to drop, validator(value, path, limits))
_Fields = dict[str, tuple[str | None, Any]]

_COMMON_SAMPLING: _Fields = {
    "top_p": ("top_p", _num_v(0, 1, lo_open=True)),
    "top_k": ("top_k", _v_top_k),
    "min_p": ("min_p", _num_v(0, 1)),
    "frequency_penalty": ("frequency_penalty", _num_v(-2, 2)),
    "presence_penalty": ("presence_penalty", _num_v(-2, 2)),
    "repetition_penalty": ("repetition_penalty", _num_v(0, 2, lo_open=True)),
    "stop": ("stop", _stop_v),
    "stop_token_ids": ("stop_token_ids", _ids_v),
    "ignore_eos": ("ignore_eos", _bool_v),
    "skip_special_tokens": ("skip_special_tokens", _bool_v),
    "spaces_between_special_tokens": ("spaces_between_special_tokens", _bool_v),
    "no_stop_trim": ("no_stop_trim", _bool_v),
    "n": (None, _v_n),
    "json_schema": (None, _v_constrained),
    "regex": (None, _v_constrained),
    "ebnf": (None, _v_constrained),
    "structural_tag": (None, _v_constrained),
    "stop_regex": (None, _v_null_only),
    "logit_bias": (None, _v_null_only),
}

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

# Top-level sampling keys of the OpenAI endpoints (SGLang's extensions included).
_OPENAI_SAMPLING: _Fields = {
    **_COMMON_SAMPLING,
    "max_tokens": ("max_new_tokens", _v_max_new),
    "min_tokens": ("min_new_tokens", _int_v(lo=0)),
    "temperature": ("temperature", _num_v(0, 2)),
    "seed": ("seed", _int_v()),
}


def _sampling_from(
    obj: Mapping[str, Any], table: _Fields, prefix: str, limits: Limits, **defaults: Any
) -> SamplingParams:
    """Validate the keys of ``obj`` found in ``table``; unknown keys are the caller's job."""
    values: dict[str, Any] = dict(defaults)
    for key, value in obj.items():
        spec = table.get(key)
        if spec is None or value is None:
            continue
        name, check = spec
        checked = check(value, prefix + key, limits)
        if name is not None:
            values[name] = checked
    params = SamplingParams(**values)
    if params.min_new_tokens > params.max_new_tokens:
        key = "min_new_tokens" if "min_new_tokens" in table else "min_tokens"
        raise ProtocolError(
            400,
            f"{prefix}{key} must be <= the maximum number of new tokens "
            f"({params.min_new_tokens} > {params.max_new_tokens})",
            prefix + key,
        )
    return params


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


def _prompts(
    v: Any, path: str, limits: Limits, *, allow_text: bool, allow_ids: bool
) -> tuple[list[str] | list[list[int]], bool, bool]:
    """``(prompts, are_ids, is_batch)`` from a ``text``/``input_ids``/``prompt`` value."""
    if allow_text and type(v) is str:
        if not v:
            raise ProtocolError(400, f"{path}: prompt is empty", path)
        return [v], False, False
    if type(v) is not list:
        kinds = []
        if allow_text:
            kinds += ["a string", "a list of strings"]
        if allow_ids:
            kinds += ["a list of token ids", "a list of token-id lists"]
        raise _bad(path, " or ".join([", ".join(kinds[:-1]), kinds[-1]]), v)
    if not v:
        raise ProtocolError(400, f"{path}: prompt is empty", path)
    first = v[0]
    if allow_text and type(first) is str:
        for i, s in enumerate(v):
            if type(s) is not str:
                raise _bad(f"{path}[{i}]", "a string", s)
            if not s:
                raise ProtocolError(400, f"{path}[{i}]: prompt is empty", f"{path}[{i}]")
        prompts: list[Any] = v
        are_ids, batch = False, True
    elif allow_ids and type(first) is list:
        for i, ids in enumerate(v):
            _int_list(ids, f"{path}[{i}]")
            if not ids:
                raise ProtocolError(400, f"{path}[{i}]: prompt is empty", f"{path}[{i}]")
        prompts, are_ids, batch = v, True, True
    elif allow_ids and _is_int(first):
        prompts, are_ids, batch = [_int_list(v, path)], True, False
    else:
        raise _bad(f"{path}[0]", "a string" if not allow_ids else "a token id or a list", first)
    if len(prompts) > limits.max_batch:
        raise ProtocolError(
            400,
            f"{path}: a batch of {len(prompts)} prompts exceeds the limit of {limits.max_batch}",
            path,
        )
    return prompts, are_ids, batch


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


def _include_usage(obj: Mapping[str, Any]) -> bool:
    opts = obj.get("stream_options")
    if opts is None:
        return False
    opts = _obj(opts, "stream_options")
    for key, value in opts.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise ProtocolError(400, f"unknown field stream_options.{key}", f"stream_options.{key}")
        if value is not None:
            _bool(value, f"stream_options.{key}")
    return bool(opts.get("include_usage"))


# ---- OpenAI endpoints -----------------------------------------------------------------------


def _openai_common(
    obj: dict[str, Any], allowed: frozenset[str], limits: Limits, **defaults: Any
) -> tuple[str, SamplingParams, bool, str | None]:
    """Unknown keys, ``model``, sampling, ``stream``, ``user``: shared by both endpoints."""
    for key in obj:
        if key not in allowed:
            raise ProtocolError(400, f"unknown field {key!r}", key)
    model = obj.get("model")
    if model is None:
        raise ProtocolError(400, "model is required", "model")
    _str(model, "model")
    for key, what in _OPENAI_UNSUPPORTED.items():
        if not _empty(obj.get(key)):
            raise _unsupported(key, what)
    for key, check in _OPENAI_HARMLESS.items():
        if obj.get(key) is not None:
            check(obj[key], key)
    sampling = _sampling_from(obj, _OPENAI_SAMPLING, "", limits, **defaults)
    stream = obj.get("stream")
    stream = False if stream is None else _bool(stream, "stream")
    user = obj.get("user")
    if user is not None:
        _str(user, "user")
    return model, sampling, stream, user


_OPENAI_HARMLESS: dict[str, Any] = {
    "user": _str,
    "routing_key": _str,
    "rid": lambda v, p: _str(v, p, nonempty=True),
    "priority": _int,
    "stream_options": _obj,
}
_OPENAI_UNSUPPORTED = {
    "lora_path": "LoRA (lora_path)",
    "return_hidden_states": "return_hidden_states",
}
_OPENAI_BASE_KEYS = frozenset(
    {"model", "stream", *_OPENAI_SAMPLING, *_OPENAI_HARMLESS, *_OPENAI_UNSUPPORTED}
)
_COMPLETION_KEYS = _OPENAI_BASE_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
_CHAT_KEYS = _OPENAI_BASE_KEYS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "continue_final_message",
    "chat_template_kwargs",
    "separate_reasoning",
    "stream_reasoning",
}


def parse_completion(body: bytes, limits: Limits = DEFAULT_LIMITS) -> CompletionRequest:
    """Parse and validate OpenAI's ``POST /v1/completions`` body.

    ``prompt``: a string, a list of strings (a batch), a list of token ids, or a list of
    id lists (a batch). ``max_tokens`` defaults to 16 (OpenAI's default; null means the
    default). ``logprobs`` (0..5) asks for each token's logprob and that many
    alternatives; with ``echo`` the prompt's logprobs too (``logprob_start_len = 0``).
    Streaming a batch is refused, as for ``/generate``. SGLang's extensions
    (``ignore_eos``, ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
    ``stop_token_ids``, ``routing_key``, ``rid``, ...) are accepted.
    """
    obj = _load_object(body)
    model, sampling, stream, user = _openai_common(obj, _COMPLETION_KEYS, limits, max_new_tokens=16)
    if "prompt" not in obj or obj["prompt"] is None:
        raise ProtocolError(400, "prompt is required", "prompt")
    prompts, are_ids, is_batch = _prompts(
        obj["prompt"], "prompt", limits, allow_text=True, allow_ids=True
    )
    if stream and is_batch:
        raise ProtocolError(
            400,
            "streaming is not supported for batch requests: send one prompt per request",
            "stream",
        )
    if obj.get("suffix") not in (None, ""):
        raise _unsupported("suffix")
    best_of = obj.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise ProtocolError(400, "best_of must be 1: this server returns one choice", "best_of")
    echo = obj.get("echo")
    echo = False if echo is None else _bool(echo, "echo")
    logprobs = obj.get("logprobs")
    if logprobs is not None:
        logprobs = _int(logprobs, "logprobs", 0, 5)
    rid = obj.get("rid")
    if rid is not None and is_batch:
        raise ProtocolError(400, "rid cannot be given for a batch of prompts", "rid")
    items = [
        GenItem(
            text=None if are_ids else p,  # type: ignore[arg-type]
            input_ids=p if are_ids else None,  # type: ignore[arg-type]
            sampling=sampling,
            return_logprob=logprobs is not None,
            logprob_start_len=0 if (echo and logprobs is not None) else -1,
            top_logprobs_num=logprobs or 0,
            return_text_in_logprobs=True,
            rid=rid,
            routing_key=obj.get("routing_key"),
        )
        for p in prompts
    ]
    return CompletionRequest(
        model=model,
        items=items,
        is_batch=is_batch,
        stream=stream,
        include_usage=_include_usage(obj),
        echo=echo,
        logprobs=logprobs,
        user=user,
    )


_ROLES = ("system", "user", "assistant", "developer", "tool")
# Message keys accepted when null/empty: what a client round-tripping a response's message
# (``message.model_dump()``) sends back.
_MESSAGE_NULLABLE = frozenset({"refusal", "annotations", "audio", "reasoning_content"})
_MESSAGE_KEYS = (
    frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "function_call"})
    | _MESSAGE_NULLABLE
)


def _message(m: Any, i: int) -> dict[str, str]:
    path = f"messages[{i}]"
    m = _obj(m, path)
    for key in m:
        if key not in _MESSAGE_KEYS:
            raise ProtocolError(400, f"unknown field {path}.{key}", f"{path}.{key}")
    role = m.get("role")
    if role not in _ROLES:
        raise _bad(f"{path}.role", "one of " + ", ".join(_ROLES), role)
    for key in ("tool_calls", "function_call"):
        if not _empty(m.get(key)):
            raise ProtocolError(
                400, f"{path}.{key}: tool calls are not supported by this server", f"{path}.{key}"
            )
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            _str(m[key], f"{path}.{key}")
    if m.get("reasoning_content") is not None:
        _str(m["reasoning_content"], f"{path}.reasoning_content")
    for key in ("annotations", "audio"):
        if not _empty(m.get(key)):
            raise _unsupported(f"{path}.{key}")
    content = m.get("content")
    if type(content) is str:
        return {"role": role, "content": content}
    if type(content) is not list:
        raise _bad(f"{path}.content", "a string or a list of text parts", content)
    texts = []
    for j, part in enumerate(content):
        ppath = f"{path}.content[{j}]"
        part = _obj(part, ppath)
        kind = part.get("type")
        if kind != "text":
            if type(kind) is not str:
                raise _bad(f"{ppath}.type", '"text"', kind)
            raise ProtocolError(
                400,
                f"{ppath}.type {kind!r} is not supported by this server (text only)",
                f"{ppath}.type",
            )
        texts.append(_str(part.get("text"), f"{ppath}.text"))
    return {"role": role, "content": "\n".join(texts)}


def parse_chat(body: bytes, limits: Limits = DEFAULT_LIMITS) -> ChatRequest:
    """Parse and validate OpenAI's ``POST /v1/chat/completions`` body.

    ``messages``: a non-empty list of ``{"role", "content"}`` with role system, user,
    assistant, developer or tool and content a string or a list of ``{"type": "text"}``
    parts (joined with newlines). Without ``max_tokens``/``max_completion_tokens`` (the
    latter wins when both are given) the limit is the server's cap, clipped to the
    context by :func:`check_prompt_length`. Tools, function calls, JSON response formats,
    images and audio are refused with a 400 naming the field.
    """
    obj = _load_object(body)
    model, sampling, stream, user = _openai_common(
        obj, _CHAT_KEYS, limits, max_new_tokens=limits.new_tokens_cap
    )
    if obj.get("max_completion_tokens") is not None:
        sampling = replace(
            sampling,
            max_new_tokens=_v_max_new(
                obj["max_completion_tokens"], "max_completion_tokens", limits
            ),
        )
        if sampling.min_new_tokens > sampling.max_new_tokens:
            raise ProtocolError(400, "min_tokens must be <= max_completion_tokens", "min_tokens")

    messages = obj.get("messages")
    if messages is None:
        raise ProtocolError(400, "messages is required", "messages")
    if type(messages) is not list or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    normalized = [_message(m, i) for i, m in enumerate(messages)]

    response_format = obj.get("response_format")
    if response_format is not None:
        kind = _obj(response_format, "response_format").get("type")
        if kind in ("json_object", "json_schema"):
            raise ProtocolError(400, f"response_format {kind}: {_CONSTRAINED}", "response_format")
        if kind != "text":
            raise _bad("response_format.type", '"text"', kind)
    for key in ("tools", "functions"):
        if not _empty(obj.get(key)):
            raise ProtocolError(400, f"{key}: tool calling is not supported by this server", key)
    for key in ("tool_choice", "function_call"):
        if obj.get(key) not in (None, "none"):
            raise ProtocolError(400, f"{key}: tool calling is not supported by this server", key)
    for key in ("audio", "prediction"):
        if not _empty(obj.get(key)):
            raise _unsupported(key)
    modalities = obj.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _bad("modalities", '["text"] (this server produces text only)', modalities)
    for key in ("parallel_tool_calls", "store", "separate_reasoning", "stream_reasoning"):
        if obj.get(key) is not None:
            _bool(obj[key], key)
    for key in ("service_tier", "reasoning_effort"):
        if obj.get(key) is not None:
            _str(obj[key], key)
    if obj.get("metadata") is not None:
        _obj(obj["metadata"], "metadata")
    kwargs = obj.get("chat_template_kwargs")
    template_kwargs = {} if kwargs is None else _obj(kwargs, "chat_template_kwargs")
    cont = obj.get("continue_final_message")
    cont = False if cont is None else _bool(cont, "continue_final_message")
    if cont and normalized[-1]["role"] != "assistant":
        raise ProtocolError(
            400,
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )

    logprobs = obj.get("logprobs")
    logprobs = False if logprobs is None else _bool(logprobs, "logprobs")
    top = obj.get("top_logprobs")
    top = 0 if top is None else _int(top, "top_logprobs", 0, limits.max_top_logprobs)
    if top and not logprobs:
        raise ProtocolError(400, "top_logprobs requires logprobs to be true", "top_logprobs")

    item = GenItem(
        text=None,
        input_ids=None,
        sampling=sampling,
        return_logprob=logprobs,
        logprob_start_len=-1,
        top_logprobs_num=top,
        return_text_in_logprobs=True,
        rid=obj.get("rid"),
        routing_key=obj.get("routing_key"),
    )
    return ChatRequest(
        model=model,
        messages=normalized,
        item=item,
        stream=stream,
        include_usage=_include_usage(obj),
        logprobs=logprobs,
        top_logprobs=top,
        user=user,
        template_kwargs=template_kwargs,
        continue_final_message=cont,
    )


def render_chat_prompt(req: ChatRequest, tokenizer: Tokenizer) -> str:
    """The prompt text of a chat request: the tokenizer's chat template over the messages.

    With ``continue_final_message`` the last (assistant) message is left open: rendered
    without a generation prompt and cut right after its content, as transformers does.
    A template that refuses the conversation (``raise_exception``) is a 400 on
    ``messages``. Encode the result with ``add_special_tokens=False``.
    """
    try:
        text = tokenizer.apply_chat_template(
            req.messages,
            add_generation_prompt=not req.continue_final_message,
            template_kwargs=req.template_kwargs,
        )
    except ChatTemplateError as e:
        raise ProtocolError(400, str(e), "messages") from None
    if req.continue_final_message:
        final = req.messages[-1]["content"]
        cut = text.rfind(final) if final else -1
        if cut < 0:
            raise ProtocolError(
                400,
                "continue_final_message: the chat template does not render the final message "
                "verbatim",
                "continue_final_message",
            )
        text = text[: cut + len(final)]
    return text


# ---- server-side checks after tokenization --------------------------------------------------


def check_ids(ids: Sequence[int], vocab_size: int, param: str = "input_ids") -> None:
    """400 when a token id is outside the vocabulary (ids were checked ``>= 0`` already)."""
    if ids and max(ids) >= vocab_size:
        i, bad = next((i, x) for i, x in enumerate(ids) if x >= vocab_size)
        raise ProtocolError(
            400,
            f"{param}[{i}] = {bad} is out of range for the vocabulary (size {vocab_size})",
            f"{param}[{i}]",
        )


def check_prompt_length(
    prompt_len: int, max_new_tokens: int, limits: Limits, param: str = "text"
) -> int:
    """The ``max_new_tokens`` that fits the context, or a 400 when the prompt alone does not.

    SGLang's rule: the prompt must be shorter than the context length, and
    ``max_new_tokens`` is silently clipped to ``context_len - prompt_len - 1`` (room for
    the final token), never raised.
    """
    if prompt_len >= limits.context_len:
        raise ProtocolError(
            400,
            f"the prompt is {prompt_len} tokens, longer than the context length "
            f"({limits.context_len} tokens) allows",
            param,
        )
    return max(0, min(max_new_tokens, limits.context_len - prompt_len - 1))


def check_logprob_start_len(
    logprob_start_len: int, prompt_len: int, param: str = "logprob_start_len"
) -> None:
    """400 when input logprobs are asked from beyond the prompt (SGLang aborts these)."""
    if logprob_start_len >= prompt_len:
        raise ProtocolError(
            400,
            f"{param} ({logprob_start_len}) must be smaller than the prompt's length "
            f"({prompt_len} tokens)",
            param,
        )


# ---- response builders ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FinishInfo:
    """Why a request ended. ``matched`` is the stop string or token id for ``"stop"``;
    ``message`` and ``status`` (the HTTP status to report) are for ``"abort"``."""

    kind: Literal["length", "stop", "abort"]
    matched: str | int | None = None
    message: str | None = None
    status: int = 500

    def sglang(self, completion_tokens: int) -> dict[str, Any]:
        if self.kind == "length":
            return {"type": "length", "length": completion_tokens}
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        return {"type": "abort", "message": self.message or "aborted", "status_code": self.status}


def finish_error(finish: FinishInfo) -> ProtocolError:
    """The error to send for an aborted request (OpenAI has no "abort" finish reason)."""
    return ProtocolError(finish.status, finish.message or "the request was aborted")


LogprobEntry = tuple[float | None, int]  # (logprob, token id); None where undefined
TopEntries = Sequence[tuple[float, int]]


@dataclass(slots=True)
class Completion:
    """What the server knows about one request when it builds a response or a chunk.

    ``text`` is the output text (stop string already trimmed unless ``no_stop_trim``);
    ``finish`` is None while the request is still running (stream chunks).
    ``input_logprobs`` covers prompt positions ``logprob_start_len ..`` with None at
    position 0 only. (SGLang itself answers None for the *first returned* position
    whatever ``logprob_start_len`` is; a real value there is better: ``sgl.select``'s
    token-healing branch subtracts that entry's logprob and would fail on None.) The
    ``*_top_logprobs`` have one list (best first) or None per position.
    ``prompt_text`` is the prompt as text (for ``echo``; decoded from ``prompt_ids`` when
    None). ``extra_meta`` is merged into ``/generate``'s ``meta_info`` (e.g. the tenant,
    queueing time).
    """

    rid: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    text: str
    finish: FinishInfo | None = None
    cached_tokens: int = 0
    e2e_s: float = 0.0
    input_logprobs: Sequence[LogprobEntry] | None = None
    output_logprobs: Sequence[LogprobEntry] | None = None
    input_top_logprobs: Sequence[TopEntries | None] | None = None
    output_top_logprobs: Sequence[TopEntries | None] | None = None
    prompt_text: str | None = None
    extra_meta: Mapping[str, Any] | None = None


def _triples(
    entries: Sequence[LogprobEntry], tokenizer: Tokenizer, with_text: bool
) -> list[list[Any]]:
    text = tokenizer.token_text
    if with_text:
        return [[lp, tid, text(tid)] for lp, tid in entries]
    return [[lp, tid, None] for lp, tid in entries]


def _top_triples(
    tops: Sequence[TopEntries | None], tokenizer: Tokenizer, with_text: bool
) -> list[list[list[Any]] | None]:
    return [None if t is None else _triples(t, tokenizer, with_text) for t in tops]


def generate_response(
    c: Completion, *, tokenizer: Tokenizer, return_text_in_logprobs: bool = False
) -> dict[str, Any]:
    """SGLang's ``/generate`` result for one prompt (a batch answers a list of these).

    ``meta_info`` has ``id``, ``finish_reason`` (``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": str_or_id}``, ``{"type": "abort", "message": ...}`` or
    None while streaming), token counts, ``cached_tokens`` and ``e2e_latency``; when
    logprobs were computed, ``input_token_logprobs`` / ``output_token_logprobs`` as
    ``[logprob, token_id, text_or_None]`` triples (text when ``return_text_in_logprobs``,
    which ``sgl.select`` needs) and, when given, ``input_top_logprobs`` /
    ``output_top_logprobs``.
    """
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": None if c.finish is None else c.finish.sglang(len(c.output_ids)),
        "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.output_ids),
        "cached_tokens": c.cached_tokens,
        "e2e_latency": c.e2e_s,
        "weight_version": "default",
    }
    if c.input_logprobs is not None or c.output_logprobs is not None:
        with_text = return_text_in_logprobs
        meta["input_token_logprobs"] = _triples(c.input_logprobs or (), tokenizer, with_text)
        meta["output_token_logprobs"] = _triples(c.output_logprobs or (), tokenizer, with_text)
        if c.input_top_logprobs is not None or c.output_top_logprobs is not None:
            meta["input_top_logprobs"] = _top_triples(
                c.input_top_logprobs or (), tokenizer, with_text
            )
            meta["output_top_logprobs"] = _top_triples(
                c.output_top_logprobs or (), tokenizer, with_text
            )
    if c.extra_meta:
        meta.update(c.extra_meta)
    return {"text": c.text, "output_ids": list(c.output_ids), "meta_info": meta}


def generate_chunk(
    c: Completion, *, tokenizer: Tokenizer, return_text_in_logprobs: bool = False
) -> dict[str, Any]:
    """One streamed ``/generate`` event: like the response, with the *cumulative* ``text``
    and ``output_ids`` so far and ``finish_reason`` None until the last (what SGLang
    sends; its frontend slices ``text[pos:]``). Send each with :func:`sse`, then
    ``SSE_DONE``."""
    return generate_response(
        c, tokenizer=tokenizer, return_text_in_logprobs=return_text_in_logprobs
    )


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(err: ProtocolError) -> bytes:
    """An error event inside a stream (the status line was sent already): OpenAI's body."""
    return b"data: " + err.body() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _openai_finish(finish: FinishInfo | None) -> str | None:
    if finish is None:
        return None
    if finish.kind == "abort":
        raise finish_error(finish)
    return finish.kind


def completion_logprobs(
    tokenizer: Tokenizer,
    entries: Sequence[LogprobEntry],
    tops: Sequence[TopEntries | None] | None = None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (``{token text: logprob}`` per position, or None) and ``text_offset``: where each
    token starts in the choice's text, counted from ``text_offset`` (for a stream chunk,
    the length of the text sent before it)."""
    tokens = [tokenizer.token_text(tid) for _, tid in entries]
    offsets = []
    pos = text_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top: list[dict[str, float] | None] | None = None
    if tops is not None:
        top = [
            None if t is None else {tokenizer.token_text(tid): lp for lp, tid in t} for t in tops
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _aligned(tops: Sequence[TopEntries | None] | None, n: int) -> list[TopEntries | None]:
    """``tops`` padded with None (or cut) to one entry per position."""
    out = list(tops or ())[:n]
    return out + [None] * (n - len(out))


def completion_response(
    completions: Sequence[Completion],
    *,
    model: str,
    created: int,
    tokenizer: Tokenizer,
    echo: bool = False,
    logprobs: int | None = None,
    id: str | None = None,
) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object, one choice per prompt (``index`` in order).

    With ``echo`` each choice's text starts with its prompt, and its logprobs with the
    prompt's (``Completion.input_logprobs`` from position 0; the first is null, as
    OpenAI's). An aborted completion raises its :func:`finish_error`. ``id`` defaults to
    ``"cmpl-" + rid`` of the first completion (likewise for the other OpenAI builders).
    """
    choices = []
    for i, c in enumerate(completions):
        prefix = ""
        if echo:
            prefix = c.prompt_text if c.prompt_text is not None else tokenizer.decode(c.prompt_ids)
        lp = None
        if logprobs is not None:
            ins = list(c.input_logprobs or ()) if echo else []
            outs = list(c.output_logprobs or ())
            tops = None
            if logprobs > 0:
                in_tops = c.input_top_logprobs if echo else ()
                tops = _aligned(in_tops, len(ins)) + _aligned(c.output_top_logprobs, len(outs))
            lp = completion_logprobs(tokenizer, ins + outs, tops)
        choice = {
            "index": i,
            "text": prefix + c.text,
            "logprobs": lp,
            "finish_reason": _openai_finish(c.finish),
        }
        if c.finish is not None and c.finish.kind == "stop":
            choice["matched_stop"] = c.finish.matched
        choices.append(choice)
    return {
        "id": id or f"cmpl-{completions[0].rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(
            sum(len(c.prompt_ids) for c in completions),
            sum(len(c.output_ids) for c in completions),
            sum(c.cached_tokens for c in completions),
        ),
    }


def completion_chunk(
    *,
    rid: str,
    model: str,
    created: int,
    text: str,
    finish: FinishInfo | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    id: str | None = None,
) -> dict[str, Any]:
    """A streamed completions chunk: ``text`` is the delta. OpenAI uses the same object
    for chunks (``finish_reason`` null until the last); an abort raises."""
    return {
        "id": id or f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": _openai_finish(finish),
            }
        ],
    }


def completion_usage_chunk(
    *, rid: str, model: str, created: int, usage: dict[str, Any], id: str | None = None
) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": id or f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def _token_logprob(tokenizer: Tokenizer, lp: float | None, tid: int) -> dict[str, Any]:
    text = tokenizer.token_text(tid)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: Tokenizer,
    entries: Sequence[LogprobEntry],
    tops: Sequence[TopEntries | None] | None = None,
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for k, (lp, tid) in enumerate(entries):
        item = _token_logprob(tokenizer, lp, tid)
        top = tops[k] if tops is not None and k < len(tops) else None
        item["top_logprobs"] = [_token_logprob(tokenizer, a, b) for a, b in (top or ())]
        content.append(item)
    return {"content": content, "refusal": None}


def chat_response(
    c: Completion,
    *,
    model: str,
    created: int,
    tokenizer: Tokenizer,
    logprobs: bool = False,
    id: str | None = None,
) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object. An aborted completion raises its
    :func:`finish_error`."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": (
            chat_logprobs(tokenizer, c.output_logprobs or (), c.output_top_logprobs)
            if logprobs
            else None
        ),
        "finish_reason": _openai_finish(c.finish),
    }
    if c.finish is not None and c.finish.kind == "stop":
        choice["matched_stop"] = c.finish.matched
    return {
        "id": id or f"chatcmpl-{c.rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(len(c.prompt_ids), len(c.output_ids), c.cached_tokens),
    }


def chat_chunk(
    *,
    rid: str,
    model: str,
    created: int,
    content: str | None = None,
    role: bool = False,
    finish: FinishInfo | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    id: str | None = None,
) -> dict[str, Any]:
    """A streamed ``chat.completion.chunk``: ``content`` is the delta (omitted when None,
    e.g. the final chunk that only carries ``finish_reason``). An abort raises."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return {
        "id": id or f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": _openai_finish(finish),
            }
        ],
    }


def chat_first_chunk(
    *, rid: str, model: str, created: int, id: str | None = None
) -> dict[str, Any]:
    """The first chat chunk: ``delta = {"role": "assistant", "content": ""}``."""
    return chat_chunk(rid=rid, model=model, created=created, content="", role=True, id=id)


def chat_usage_chunk(
    *, rid: str, model: str, created: int, usage: dict[str, Any], id: str | None = None
) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": id or f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


# ---- info endpoints -------------------------------------------------------------------------


def models_response(
    model_name: str, *, created: int = 0, max_model_len: int | None = None
) -> dict[str, Any]:
    """``GET /v1/models``: the one served model."""
    card: dict[str, Any] = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "sgl-fair",
        "root": model_name,
    }
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def model_info(
    model_path: str,
    *,
    tokenizer_path: str | None = None,
    served_model_name: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``GET /get_model_info`` as SGLang answers it. Its frontend (``RuntimeEndpoint``)
    reads ``model_path`` to pick a chat template, so it is the model's path or hub id."""
    info: dict[str, Any] = {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path if tokenizer_path is not None else model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "served_model_name": served_model_name if served_model_name is not None else model_path,
    }
    info.update(extra)
    return info


def server_info(
    *,
    model_path: str,
    served_model_name: str,
    context_len: int,
    version: str,
    server_args: Mapping[str, Any] | None = None,
    internal_states: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``GET /get_server_info``: the server's arguments flattened at the top level (as
    SGLang does), ``version`` and ``internal_states`` (one dict per worker; SGLang's
    benchmark reads ``internal_states[0]["avg_spec_accept_length"]`` when present)."""
    info: dict[str, Any] = dict(server_args or {})
    info.update(
        model_path=model_path,
        served_model_name=served_model_name,
        context_length=context_len,
        version=version,
        internal_states=(
            [dict(s) for s in internal_states]
            if internal_states
            else [{"avg_spec_accept_length": None}]
        ),
    )
    info.update(extra)
    return info
