"""Request parsing/validation and response building for the HTTP front (pure functions).

The server (Starlette) hands raw body bytes to ``parse_generate`` (SGLang-native
``POST /generate``), ``parse_completion`` (``POST /v1/completions``) or ``parse_chat``
(``POST /v1/chat/completions``) and gets back normalized :class:`GenItem` s, one per
prompt, whatever the wire shape was. Every validation failure raises
:class:`ProtocolError`, whose ``body()`` is OpenAI's error JSON. The builders turn a
finished (or in-progress) :class:`Completion` into SGLang's ``/generate`` JSON or OpenAI's
shapes.

One module per job; import the names from here (``from sgl_fair.router import protocol as P``)::

    errors.py             ProtocolError and OpenAI's error body
    requests_common.py    Limits, SamplingParams, GenItem; the field checks and sampling keys
                          both wire formats share; the checks after tokenization
    requests_sglang.py    POST /generate
    requests_openai.py    POST /v1/completions and /v1/chat/completions; the chat prompt
    scheduling.py         service class (RT/BE), SLOs, interaction: body, headers, defaults;
                          FairServe's throttling reasons
    responses.py          Completion, FinishInfo; SGLang's /generate result and events; SSE
                          framing; the info endpoints
    responses_openai.py   OpenAI's objects, stream chunks, logprobs and usage

Pure: no network, no torch, no sglang.
"""

from sgl_fair.router.protocol.errors import ProtocolError, error_type
from sgl_fair.router.protocol.requests_common import (
    DEFAULT_LIMITS,
    NO_PASSTHROUGH,
    EngineFeatures,
    GenItem,
    Limits,
    SamplingParams,
    check_ids,
    check_logprob_start_len,
    check_prompt_length,
)
from sgl_fair.router.protocol.requests_openai import (
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    render_chat_prompt,
)
from sgl_fair.router.protocol.requests_sglang import GenerateRequest, parse_generate
from sgl_fair.router.protocol.responses import (
    SSE_DONE,
    Completion,
    FinishInfo,
    finish_error,
    generate_chunk,
    generate_response,
    model_info,
    models_response,
    server_info,
    sse,
    sse_error,
)
from sgl_fair.router.protocol.responses_openai import (
    chat_chunk,
    chat_first_chunk,
    chat_logprobs,
    chat_response,
    chat_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_response,
    completion_usage_chunk,
    usage,
)
from sgl_fair.router.protocol.scheduling import (
    Hints,
    Scheduling,
    Throttle,
    parse_hints,
    throttle_of,
)
from sgl_fair.router.protocol.scheduling import resolve as resolve_scheduling

__all__ = [
    "DEFAULT_LIMITS",
    "NO_PASSTHROUGH",
    "SSE_DONE",
    "ChatRequest",
    "Completion",
    "CompletionRequest",
    "EngineFeatures",
    "FinishInfo",
    "GenItem",
    "GenerateRequest",
    "Hints",
    "Limits",
    "ProtocolError",
    "SamplingParams",
    "Scheduling",
    "Throttle",
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
    "parse_hints",
    "throttle_of",
    "render_chat_prompt",
    "resolve_scheduling",
    "server_info",
    "sse",
    "sse_error",
    "usage",
]
