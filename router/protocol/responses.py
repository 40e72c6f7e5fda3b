"""What the server reports about a request, in SGLang's shapes; the SSE framing; the info
endpoints' bodies.

:class:`Completion` is one request as the server knows it when it answers (finished, or in
progress for a stream chunk), :class:`FinishInfo` why it ended. From it come SGLang's
``/generate`` result and stream events (OpenAI's shapes are in ``responses_openai``). Timing
and usage come in as arguments, so everything here is deterministic and testable without a
server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from sgl_fair.router.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from sgl_fair.router.tokenizer import Tokenizer


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
