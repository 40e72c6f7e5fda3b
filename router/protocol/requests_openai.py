"""OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``: the bodies parsed and
validated into a :class:`CompletionRequest` / :class:`ChatRequest`.

Both endpoints share ``model``, the top-level sampling keys (SGLang's extensions included),
``stream`` and ``user``; unknown fields are ignored and any ``model`` name is accepted
(the served model answers), as SGLang does. ``n`` > 1 asks for that many samples. Chat
messages are normalized to ``{"role", "content"}``; the
tokenizer's chat template renders them to the prompt (:func:`render_chat_prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec

from sgl_fair.router.protocol.errors import ProtocolError
from sgl_fair.router.protocol.fields import (
    FieldTable,
    bad_value,
    check_bool,
    check_int,
    check_obj,
    check_str,
    is_empty,
    is_int,
    load_object,
    unsupported,
    v_int,
    v_max_new,
    v_num,
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
from sgl_fair.router.protocol.requests_sglang import NOT_RELAYED
from sgl_fair.router.protocol.scheduling import SCHEDULING_FIELDS, parse_hints
from sgl_fair.router.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from sgl_fair.router.tokenizer import Tokenizer


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


# Top-level sampling keys of the OpenAI endpoints (SGLang's extensions included).
_OPENAI_SAMPLING: FieldTable = {
    **COMMON_SAMPLING,
    "max_tokens": ("max_new_tokens", v_max_new),
    "min_tokens": ("min_new_tokens", v_int(lo=0)),
    "temperature": ("temperature", v_num(0, 2)),
    "seed": ("seed", v_int()),
}


def _openai_common(
    obj: dict[str, Any], limits: Limits, features: EngineFeatures, **defaults: Any
) -> tuple[str, SamplingParams, bool, str | None, dict[str, Any] | None]:
    """``model``, sampling, ``stream``, ``user`` and the fields passed through to SGLang:
    shared by both endpoints. Unknown keys are ignored, as SGLang ignores them; ``model``
    may name anything (the served model answers)."""
    model = obj.get("model")
    if model is None:
        raise ProtocolError(400, "model is required", "model")
    check_str(model, "model")
    extra: dict[str, Any] = {}
    for key, why in _OPENAI_SIM_REFUSED.items():
        v = obj.get(key)
        if is_empty(v):
            continue
        if not features.passthrough:
            raise sim_refusal(key, why)
        extra[key] = v
    for key in ("return_hidden_states", "return_routed_experts"):
        if not is_empty(obj.get(key)):
            raise ProtocolError(400, f"{key} {NOT_RELAYED}", key)
    for key, check in _OPENAI_HARMLESS.items():
        if obj.get(key) is not None:
            check(obj[key], key)
    sampling = sampling_from(obj, _OPENAI_SAMPLING, "", limits, features, **defaults)
    stream = obj.get("stream")
    stream = False if stream is None else check_bool(stream, "stream")
    user = obj.get("user")
    if user is not None:
        check_str(user, "user")
    return model, sampling, stream, user, extra or None


_OPENAI_HARMLESS: dict[str, Any] = {
    "user": check_str,
    "routing_key": check_str,
    "rid": lambda v, p: check_str(v, p, nonempty=True),
    "priority": check_int,
    "stream_options": check_obj,
}
# SGLang's extensions passed through to its /generate on --backend sglang; refused on the
# simulated engine when set.
_OPENAI_SIM_REFUSED = {
    "lora_path": "LoRA (lora_path)",
    "custom_logit_processor": "a custom logit processor",
}
# The fields each endpoint knows (anything else is ignored; docs/compatibility.md).
_OPENAI_BASE_KEYS = frozenset(
    {
        "model",
        "stream",
        "return_hidden_states",
        "return_routed_experts",
        *_OPENAI_SAMPLING,
        *_OPENAI_HARMLESS,
        *_OPENAI_SIM_REFUSED,
        *SCHEDULING_FIELDS,
    }
)
COMPLETION_FIELDS = _OPENAI_BASE_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _OPENAI_BASE_KEYS | {
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


def parse_completion(
    body: bytes, limits: Limits = DEFAULT_LIMITS, features: EngineFeatures = NO_PASSTHROUGH
) -> CompletionRequest:
    """Parse and validate OpenAI's ``POST /v1/completions`` body.

    ``prompt``: a string, a list of strings (a batch), a list of token ids, or a list of
    id lists (a batch). ``max_tokens`` defaults to 16 (OpenAI's default; null means the
    default). ``logprobs`` (0..5) asks for each token's logprob and that many
    alternatives; with ``echo`` the prompt's logprobs too (``logprob_start_len = 0``).
    Streaming a batch is refused, as for ``/generate``. SGLang's extensions
    (``ignore_eos``, ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
    ``stop_token_ids``, ``routing_key``, ``rid``, ...) are accepted.
    """
    obj = load_object(body)
    model, sampling, stream, user, extra = _openai_common(obj, limits, features, max_new_tokens=16)
    if "prompt" not in obj or obj["prompt"] is None:
        raise ProtocolError(400, "prompt is required", "prompt")
    prompts, are_ids, is_batch = parse_prompts(
        obj["prompt"], "prompt", limits, allow_text=True, allow_ids=True
    )
    if stream and is_batch:
        raise ProtocolError(
            400,
            "streaming is not supported for batch requests: send one prompt per request",
            "stream",
        )
    if obj.get("suffix") not in (None, ""):
        raise unsupported("suffix")
    best_of = obj.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != sampling.n):
        raise ProtocolError(
            400, f"best_of must equal n ({sampling.n}): every sample is returned", "best_of"
        )
    echo = obj.get("echo")
    echo = False if echo is None else check_bool(echo, "echo")
    logprobs = obj.get("logprobs")
    if logprobs is not None:
        logprobs = check_int(logprobs, "logprobs", 0, 5)
    rid = obj.get("rid")
    if rid is not None and is_batch:
        raise ProtocolError(400, "rid cannot be given for a batch of prompts", "rid")
    hints = parse_hints(obj)
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
            extra=extra,
            hints=hints,
        )
        for p in prompts
    ]
    return CompletionRequest(
        model=model,
        items=items,
        is_batch=is_batch,
        stream=stream,
        include_usage=include_usage(obj),
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
    m = check_obj(m, path)
    for key in m:
        if key not in _MESSAGE_KEYS:
            raise ProtocolError(400, f"unknown field {path}.{key}", f"{path}.{key}")
    role = m.get("role")
    if role not in _ROLES:
        raise bad_value(f"{path}.role", "one of " + ", ".join(_ROLES), role)
    for key in ("tool_calls", "function_call"):
        if not is_empty(m.get(key)):
            raise ProtocolError(
                400, f"{path}.{key}: tool calls are not supported by this server", f"{path}.{key}"
            )
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            check_str(m[key], f"{path}.{key}")
    if m.get("reasoning_content") is not None:
        check_str(m["reasoning_content"], f"{path}.reasoning_content")
    for key in ("annotations", "audio"):
        if not is_empty(m.get(key)):
            raise unsupported(f"{path}.{key}")
    content = m.get("content")
    if type(content) is str:
        return {"role": role, "content": content}
    if type(content) is not list:
        raise bad_value(f"{path}.content", "a string or a list of text parts", content)
    if not content:  # OpenAI refuses an empty parts list too
        raise ProtocolError(
            400, f"{path}.content is an empty list: give a string or at least one text part",
            f"{path}.content",
        )  # fmt: skip
    texts = []
    for j, part in enumerate(content):
        ppath = f"{path}.content[{j}]"
        part = check_obj(part, ppath)
        kind = part.get("type")
        if kind != "text":
            if type(kind) is not str:
                raise bad_value(f"{ppath}.type", '"text"', kind)
            raise ProtocolError(
                400,
                f"{ppath}.type {kind!r} is not supported by this server (text only)",
                f"{ppath}.type",
            )
        texts.append(check_str(part.get("text"), f"{ppath}.text"))
    return {"role": role, "content": "\n".join(texts)}


def parse_chat(
    body: bytes, limits: Limits = DEFAULT_LIMITS, features: EngineFeatures = NO_PASSTHROUGH
) -> ChatRequest:
    """Parse and validate OpenAI's ``POST /v1/chat/completions`` body.

    ``messages``: a non-empty list of ``{"role", "content"}`` with role system, user,
    assistant, developer or tool and content a string or a list of ``{"type": "text"}``
    parts (joined with newlines). Without ``max_tokens``/``max_completion_tokens`` (the
    latter wins when both are given) the limit is the server's cap, clipped to the
    context by :func:`check_prompt_length`. Tools, function calls, JSON response formats,
    images and audio are refused with a 400 naming the field.
    """
    obj = load_object(body)
    model, sampling, stream, user, extra = _openai_common(
        obj, limits, features, max_new_tokens=limits.new_tokens_cap
    )
    if obj.get("max_completion_tokens") is not None:
        sampling = replace(
            sampling,
            max_new_tokens=v_max_new(obj["max_completion_tokens"], "max_completion_tokens", limits),
        )
        if sampling.min_new_tokens > sampling.max_new_tokens:
            raise ProtocolError(400, "min_tokens must be <= max_completion_tokens", "min_tokens")

    messages = obj.get("messages")
    if messages is None:
        raise ProtocolError(400, "messages is required", "messages")
    if type(messages) is not list or not messages:
        raise bad_value("messages", "a non-empty list of messages", messages)
    normalized = [_message(m, i) for i, m in enumerate(messages)]

    sampling = _response_format(obj.get("response_format"), sampling, features)
    for key in ("tools", "functions"):
        if not is_empty(obj.get(key)):
            raise ProtocolError(400, f"{key}: tool calling is not supported by this server", key)
    for key in ("tool_choice", "function_call"):
        if obj.get(key) not in (None, "none"):
            raise ProtocolError(400, f"{key}: tool calling is not supported by this server", key)
    for key in ("audio", "prediction"):
        if not is_empty(obj.get(key)):
            raise unsupported(key)
    modalities = obj.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_value("modalities", '["text"] (this server produces text only)', modalities)
    for key in ("parallel_tool_calls", "store", "separate_reasoning", "stream_reasoning"):
        if obj.get(key) is not None:
            check_bool(obj[key], key)
    for key in ("service_tier", "reasoning_effort"):
        if obj.get(key) is not None:
            check_str(obj[key], key)
    if obj.get("metadata") is not None:
        check_obj(obj["metadata"], "metadata")
    kwargs = obj.get("chat_template_kwargs")
    template_kwargs = {} if kwargs is None else check_obj(kwargs, "chat_template_kwargs")
    cont = obj.get("continue_final_message")
    cont = False if cont is None else check_bool(cont, "continue_final_message")
    if cont and normalized[-1]["role"] != "assistant":
        raise ProtocolError(
            400,
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )

    logprobs = obj.get("logprobs")
    logprobs = False if logprobs is None else check_bool(logprobs, "logprobs")
    top = obj.get("top_logprobs")
    top = 0 if top is None else check_int(top, "top_logprobs", 0, limits.max_top_logprobs)
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
        extra=extra,
        hints=parse_hints(obj),
    )
    return ChatRequest(
        model=model,
        messages=normalized,
        item=item,
        stream=stream,
        include_usage=include_usage(obj),
        logprobs=logprobs,
        top_logprobs=top,
        user=user,
        template_kwargs=template_kwargs,
        continue_final_message=cont,
    )


def _response_format(rf: Any, sampling: SamplingParams, features: EngineFeatures) -> SamplingParams:
    """OpenAI's ``response_format``: ``text`` is the default; ``json_object`` /
    ``json_schema`` / ``structural_tag`` become SGLang's constrained-decoding sampling keys
    on ``--backend sglang`` (as SGLang's OpenAI layer does) and are refused on the sim."""
    if rf is None:
        return sampling
    kind = check_obj(rf, "response_format").get("type")
    if kind == "text":
        return sampling
    if kind not in ("json_object", "json_schema", "structural_tag"):
        kinds = '"text", "json_object", "json_schema" or "structural_tag"'
        raise bad_value("response_format.type", kinds, kind)
    if not features.passthrough:
        raise sim_refusal("response_format", f"constrained decoding ({kind})")
    if kind == "json_object":
        extra = {"json_schema": '{"type": "object"}'}
    elif kind == "json_schema":
        spec = check_obj(rf.get("json_schema"), "response_format.json_schema")
        schema = spec.get("schema", spec.get("schema_", {}))
        extra = {"json_schema": msgspec.json.encode(schema).decode()}
    else:
        extra = {"structural_tag": msgspec.json.encode(rf).decode()}
    return replace(sampling, engine_extra={**(sampling.engine_extra or {}), **extra})


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
