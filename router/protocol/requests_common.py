"""What every request parser shares: the normalized request, the field checks, the sampling
table, and the checks that run after tokenization.

The parsers (``requests_sglang``, ``requests_openai``) turn a body into :class:`GenItem` s
with validated :class:`SamplingParams` under the server's :class:`Limits`. Every failure is a
:class:`ProtocolError` naming the offending field with a JSON path
(``sampling_params.max_new_tokens must be an integer >= 0 (got -5)``), because the person
reading the 400 is debugging a client.

SGLang's contract (``docs/compatibility.md``): unknown keys at the top level of a body are
ignored, as SGLang ignores them (gateways add fields; SGLang's own clients send fields of
newer releases), but unknown keys inside ``sampling_params`` are a 400 naming them, as SGLang
refuses them. Every known field's *value* is checked and a bad one is a 400 naming it.
Features that only a real engine has (constrained decoding, LoRA, custom logit processors,
images) are passed through untouched to an engine that takes them (``--backend sglang``:
:class:`EngineFeatures` ``passthrough``) and refused on the others with a 400 that says why,
never silently dropped.
``null`` always means "not given": SGLang's own frontend sends ``"regex": null`` and
``"json_schema": null`` with every request.

The ``_``-named helpers are this package's own (the parsers import them), not its API.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from sgl_fair.router.protocol.errors import ProtocolError

# ---- limits and normalized requests ---------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Server-wide request limits. ``max_new_tokens_cap`` None means ``context_len``."""

    context_len: int = 8192
    max_new_tokens_cap: int | None = None
    max_batch: int = 256
    max_stop: int = 16
    max_top_logprobs: int = 20
    max_n: int = 64  # parallel samples per prompt (OpenAI ``n``, SGLang ``sampling_params.n``)

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
    n: int = 1  # parallel samples of the prompt: n requests sharing its KV prefix
    # Keys passed through untouched to SGLang's sampling_params (``--backend sglang`` only:
    # constrained decoding, logit_bias, custom_params, ...); None when there are none.
    engine_extra: Mapping[str, Any] | None = None


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
    # Top-level fields passed through untouched to SGLang's /generate (``--backend sglang``:
    # lora_path, custom_logit_processor, image_data, ...); None when there are none.
    extra: dict[str, Any] | None = None
    return_prompt_token_ids: bool = False
    # The request's scheduling fields as its body gave them (``scheduling.Hints``: service
    # class, SLOs, interaction); None: none given. Headers and defaults are merged later.
    hints: Any = None


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


# ---- sampling parameters: the keys both wire formats share ----------------------------------
# (each parser adds its own: requests_sglang's sampling_params, requests_openai's top level)

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


def _v_n(v: Any, path: str, limits: Limits) -> int:
    return _int(v, path, 1, limits.max_n)


def _v_null_only(v: Any, path: str, limits: Limits) -> None:
    if not _empty(v):
        raise _unsupported(path)


@dataclass(frozen=True)
class EngineFeatures:
    """What the workers' engine honours beyond the router's own fields; the parsers ask this,
    never the engine's name (the launcher's backend declares it: ``--backend sglang``'s
    servers pass through, the simulated and torch engines do not).

    ``passthrough``: the fields only a real engine can honour (constrained decoding,
    ``logit_bias``, LoRA, custom logit processors, multimodal input, sessions, ...) go to it
    untouched (``SamplingParams.engine_extra``, ``GenItem.extra``); without it each one set
    is a 400 that says why, never silently dropped."""

    passthrough: bool = False


NO_PASSTHROUGH = EngineFeatures()


SIM_ONLY = "on the simulated engine; it is passed through to SGLang on --backend sglang"


def sim_refusal(path: str, why: str) -> ProtocolError:
    """The 400 for a field only a real engine can honour, asked of the simulated one."""
    return ProtocolError(400, f"{path}: {why} is not possible {SIM_ONLY}", path)


@dataclass(frozen=True)
class _Pass:
    """A key passed through untouched to an engine with ``EngineFeatures.passthrough``,
    refused on the others with ``why`` when it is set; ``check`` validates its value first."""

    why: str
    check: Any = None


def _any_v(v: Any, path: str, limits: Limits) -> Any:
    return v


def _str_v(v: Any, path: str, limits: Limits) -> str:
    return _str(v, path)


def _obj_v(v: Any, path: str, limits: Limits) -> dict[str, Any]:
    return _obj(v, path)


def _str_or_list_v(v: Any, path: str, limits: Limits) -> Any:
    if type(v) is str:
        return v
    if type(v) is not list or any(type(x) is not str for x in v):
        raise _bad(path, "a string or a list of strings", v)
    return v


def _str_list_v(v: Any, path: str, limits: Limits) -> list[str]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise _bad(path, "a list of strings", v)
    return v


def _str_or_obj_v(v: Any, path: str, limits: Limits) -> Any:
    if type(v) not in (str, dict):
        raise _bad(path, "a string or an object", v)
    return v


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


# wire key -> (SamplingParams field or None to drop, validator(value, path, limits)),
# or a _Pass: passed through to SGLang, refused on the simulated engine.
_Fields = dict[str, Any]
_CONSTRAINED_WHY = "constrained decoding"

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
    "n": ("n", _v_n),
    "json_schema": _Pass(_CONSTRAINED_WHY, _str_or_obj_v),
    "regex": _Pass(_CONSTRAINED_WHY, _str_v),
    "ebnf": _Pass(_CONSTRAINED_WHY, _str_v),
    "structural_tag": _Pass(_CONSTRAINED_WHY, _str_or_obj_v),
    "stop_regex": _Pass("stopping on a regular expression", _str_or_list_v),
    "logit_bias": _Pass("logit_bias (the simulated engine has no logits)", _obj_v),
}


def _sampling_from(
    obj: Mapping[str, Any],
    table: _Fields,
    prefix: str,
    limits: Limits,
    features: EngineFeatures = NO_PASSTHROUGH,
    **defaults: Any,
) -> SamplingParams:
    """Validate the keys of ``obj`` found in ``table``; unknown keys are the caller's job.
    ``_Pass`` keys go to ``engine_extra`` when ``features.passthrough``; otherwise they are
    refused when set (``false``/``null``/empty mean not set)."""
    values: dict[str, Any] = dict(defaults)
    extra: dict[str, Any] = {}
    for key, value in obj.items():
        spec = table.get(key)
        if spec is None or value is None:
            continue
        if isinstance(spec, _Pass):
            if spec.check is not None:
                spec.check(value, prefix + key, limits)
            if _empty(value):
                continue
            if not features.passthrough:
                raise sim_refusal(prefix + key, spec.why)
            extra[key] = value
            continue
        name, check = spec
        checked = check(value, prefix + key, limits)
        if name is not None:
            values[name] = checked
    if extra:
        values["engine_extra"] = extra
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


# ---- prompts and stream options: the same shapes on every endpoint --------------------------


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
