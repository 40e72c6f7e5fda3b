"""OpenAI's response shapes built from :class:`Completion` s: ``text_completion`` and
``chat.completion`` objects, their stream chunks, logprobs and usage.

OpenAI has no "abort" finish reason: a builder given an aborted completion raises its
:func:`finish_error` for the server to send instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sgl_fair.router.protocol.responses import (
    Completion,
    FinishInfo,
    LogprobEntry,
    TopEntries,
    finish_error,
)

if TYPE_CHECKING:
    from sgl_fair.router.tokenizer import Tokenizer


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
    n: int = 1,
) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object, one choice per prompt and sample (``index`` in
    order: prompt ``p``'s sample ``j`` is choice ``p * n + j``); usage counts each prompt
    once however many samples it has.

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
            sum(len(c.prompt_ids) for c in completions[::n]),
            sum(len(c.output_ids) for c in completions),
            sum(c.cached_tokens for c in completions[::n]),
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
    c: Completion | Sequence[Completion],
    *,
    model: str,
    created: int,
    tokenizer: Tokenizer,
    logprobs: bool = False,
    id: str | None = None,
) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` object: one choice, or one per sample when given a list
    (``n`` > 1; usage counts the prompt once). An aborted completion raises its
    :func:`finish_error`."""
    cs = [c] if isinstance(c, Completion) else list(c)
    choices = []
    for i, one in enumerate(cs):
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": one.text},
            "logprobs": (
                chat_logprobs(tokenizer, one.output_logprobs or (), one.output_top_logprobs)
                if logprobs
                else None
            ),
            "finish_reason": _openai_finish(one.finish),
        }
        if one.finish is not None and one.finish.kind == "stop":
            choice["matched_stop"] = one.finish.matched
        choices.append(choice)
    first = cs[0]
    return {
        "id": id or f"chatcmpl-{first.rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(
            len(first.prompt_ids), sum(len(x.output_ids) for x in cs), first.cached_tokens
        ),
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
    *, rid: str, model: str, created: int, id: str | None = None, index: int = 0
) -> dict[str, Any]:
    """The first chat chunk: ``delta = {"role": "assistant", "content": ""}``."""
    return chat_chunk(
        rid=rid, model=model, created=created, content="", role=True, id=id, index=index
    )


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
