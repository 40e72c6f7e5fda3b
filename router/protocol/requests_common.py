"""What every request parser shares: the normalized request, the field checks, the sampling
table, and the checks that run after tokenization.

The parsers (``requests_sglang``, ``requests_openai``) turn a body into :class:`GenItem` s
with validated :class:`SamplingParams` under the server's :class:`Limits`. Every failure is a
:class:`ProtocolError` naming the offending field with a JSON path
(``sampling_params.max_new_tokens must be an integer >= 0 (got -5)``), because the person
reading the 400 is debugging a client; the checks of one value are in ``fields.py``.

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sgl_fair.router.protocol.errors import ProtocolError
from sgl_fair.router.protocol.fields import (
    FieldTable,
    PassThrough,
    bad_value,
    check_bool,
    check_int_list,
    check_obj,
    is_empty,
    is_int,
    v_bool,
    v_ids,
    v_n,
    v_num,
    v_obj,
    v_stop,
    v_str,
    v_str_or_list,
    v_str_or_obj,
    v_top_k,
)

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


# ---- sampling parameters: the keys both wire formats share ----------------------------------
# (each parser adds its own: requests_sglang's sampling_params, requests_openai's top level)


@dataclass(frozen=True)
class EngineFeatures:
    """What the workers' engine honours beyond the router's own fields; the parsers ask this,
    never the engine's name (the launcher's backend declares it: ``--backend sglang``'s
    servers pass through, the simulated and torch engines do not).

    ``passthrough``: the fields only a real engine can honour (constrained decoding,
    ``logit_bias``, LoRA, custom logit processors, multimodal input, sessions, ...) go to it
    untouched (``SamplingParams.engine_extra``, ``GenItem.extra``); without it each one set
    is a 400 that says why, never silently dropped.

    ``simulated``: the workers run our simulated engine, so its GPU, model and time scale are
    what serves (``/server_info`` reports them; for a real engine they are not).
    """

    passthrough: bool = False
    simulated: bool = False


NO_PASSTHROUGH = EngineFeatures()


SIM_ONLY = "on the simulated engine; it is passed through to SGLang on --backend sglang"


def sim_refusal(path: str, why: str) -> ProtocolError:
    """The 400 for a field only a real engine can honour, asked of the simulated one."""
    return ProtocolError(400, f"{path}: {why} is not possible {SIM_ONLY}", path)


CONSTRAINED_WHY = "constrained decoding"

COMMON_SAMPLING: FieldTable = {
    "top_p": ("top_p", v_num(0, 1, lo_open=True)),
    "top_k": ("top_k", v_top_k),
    "min_p": ("min_p", v_num(0, 1)),
    "frequency_penalty": ("frequency_penalty", v_num(-2, 2)),
    "presence_penalty": ("presence_penalty", v_num(-2, 2)),
    "repetition_penalty": ("repetition_penalty", v_num(0, 2, lo_open=True)),
    "stop": ("stop", v_stop),
    "stop_token_ids": ("stop_token_ids", v_ids),
    "ignore_eos": ("ignore_eos", v_bool),
    "skip_special_tokens": ("skip_special_tokens", v_bool),
    "spaces_between_special_tokens": ("spaces_between_special_tokens", v_bool),
    "no_stop_trim": ("no_stop_trim", v_bool),
    "n": ("n", v_n),
    "json_schema": PassThrough(CONSTRAINED_WHY, v_str_or_obj),
    "regex": PassThrough(CONSTRAINED_WHY, v_str),
    "ebnf": PassThrough(CONSTRAINED_WHY, v_str),
    "structural_tag": PassThrough(CONSTRAINED_WHY, v_str_or_obj),
    "stop_regex": PassThrough("stopping on a regular expression", v_str_or_list),
    "logit_bias": PassThrough("logit_bias (the simulated engine has no logits)", v_obj),
}


def sampling_from(
    obj: Mapping[str, Any],
    table: FieldTable,
    prefix: str,
    limits: Limits,
    features: EngineFeatures = NO_PASSTHROUGH,
    **defaults: Any,
) -> SamplingParams:
    """Validate the keys of ``obj`` found in ``table``; unknown keys are the caller's job.
    ``PassThrough`` keys go to ``engine_extra`` when ``features.passthrough``; otherwise they are
    refused when set (``false``/``null``/empty mean not set)."""
    values: dict[str, Any] = dict(defaults)
    extra: dict[str, Any] = {}
    for key, value in obj.items():
        spec = table.get(key)
        if spec is None or value is None:
            continue
        if isinstance(spec, PassThrough):
            if spec.check is not None:
                spec.check(value, prefix + key, limits)
            if is_empty(value):
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


def parse_prompts(
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
        raise bad_value(path, " or ".join([", ".join(kinds[:-1]), kinds[-1]]), v)
    if not v:
        raise ProtocolError(400, f"{path}: prompt is empty", path)
    first = v[0]
    if allow_text and type(first) is str:
        for i, s in enumerate(v):
            if type(s) is not str:
                raise bad_value(f"{path}[{i}]", "a string", s)
            if not s:
                raise ProtocolError(400, f"{path}[{i}]: prompt is empty", f"{path}[{i}]")
        prompts: list[Any] = v
        are_ids, batch = False, True
    elif allow_ids and type(first) is list:
        for i, ids in enumerate(v):
            check_int_list(ids, f"{path}[{i}]")
            if not ids:
                raise ProtocolError(400, f"{path}[{i}]: prompt is empty", f"{path}[{i}]")
        prompts, are_ids, batch = v, True, True
    elif allow_ids and is_int(first):
        prompts, are_ids, batch = [check_int_list(v, path)], True, False
    else:
        raise bad_value(
            f"{path}[0]", "a string" if not allow_ids else "a token id or a list", first
        )
    if len(prompts) > limits.max_batch:
        raise ProtocolError(
            400,
            f"{path}: a batch of {len(prompts)} prompts exceeds the limit of {limits.max_batch}",
            path,
        )
    return prompts, are_ids, batch


def include_usage(obj: Mapping[str, Any]) -> bool:
    opts = obj.get("stream_options")
    if opts is None:
        return False
    opts = check_obj(opts, "stream_options")
    for key, value in opts.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise ProtocolError(400, f"unknown field stream_options.{key}", f"stream_options.{key}")
        if value is not None:
            check_bool(value, f"stream_options.{key}")
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
