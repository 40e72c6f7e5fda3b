"""OpenAI-compatible endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each
with SSE streaming, ``stream_options.include_usage`` and ``n`` parallel samples),
``GET /v1/models`` and ``GET /v1/models/{id}``.

Any ``model`` name is answered by the served model, as SGLang does (gateways pass the client's
name through); responses report the served name.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sgl_fair.router import protocol as P
from sgl_fair.router.generation import Generation
from sgl_fair.router.http_io import JSON, read_json_body
from sgl_fair.router.lifecycle import done_all, first_events, merged_updates, prepare, until_done
from sgl_fair.router.state import Identity, ServerState


def with_system_len(item: Any, messages: list[dict[str, str]], tok: Any, headers: Any) -> Any:
    """``item`` with FairServe's ``L_S`` set to its system (and developer) messages' tokens,
    unless the body (``system_len``) or the ``X-System-Len`` header declares one (or it has
    none)."""
    hints = item.hints
    if (hints is not None and hints.system_len is not None) or "x-system-len" in headers:
        return item
    n = sum(
        len(tok.encode(m["content"], add_special_tokens=False))
        for m in messages
        if m["role"] in ("system", "developer")
    )
    if not n:
        return item
    return replace(item, hints=replace(hints if hints is not None else P.Hints(), system_len=n))


async def completions(state: ServerState, request: HTTPRequest) -> Response:
    body = await read_json_body(request, state.cfg.max_body_bytes)
    req = P.parse_completion(body, state.limits, state.features)
    who, gens = prepare(state, request, req.items, "prompt", req.user)
    created = int(time.time())
    cid = f"cmpl-{uuid.uuid4().hex}"
    if req.stream:
        await first_events(state, request, gens, who)  # refused before a token: its status
        return openai_stream(state, gens, who, req, cid, created, chat=False)
    await until_done(state, request, gens, who)
    return JSON(
        P.completion_response(
            [g.completion() for g in gens], model=state.model_name, created=created,
            tokenizer=state.tokenizer, echo=req.echo, logprobs=req.logprobs, id=cid,
            n=req.items[0].sampling.n,
        )
    )  # fmt: skip


async def chat_completions(state: ServerState, request: HTTPRequest) -> Response:
    tok = state.tokenizer
    body = await read_json_body(request, state.cfg.max_body_bytes)
    req = P.parse_chat(body, state.limits, state.features)
    item = req.item_for(P.render_chat_prompt(req, tok))
    item = with_system_len(item, req.messages, tok, request.headers)
    who, gens = prepare(state, request, [item], "messages", req.user, chat=True)
    created = int(time.time())
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        await first_events(state, request, gens, who)  # refused before a token: its status
        return openai_stream(state, gens, who, req, cid, created, chat=True)
    await until_done(state, request, gens, who)
    return JSON(
        P.chat_response(
            [g.completion() for g in gens], model=state.model_name, created=created,
            tokenizer=tok, logprobs=bool(req.logprobs), id=cid,
        )
    )  # fmt: skip


def openai_stream(
    state: ServerState, gens: list[Generation], who: Identity, req: Any, cid: str,
    created: int, *, chat: bool,
) -> StreamingResponse:  # fmt: skip
    return StreamingResponse(
        stream_openai(state, gens, who, req, cid, created, chat=chat),
        media_type="text/event-stream",
    )


async def stream_openai(
    state: ServerState, gens: list[Generation], who: Identity, req: Any, cid: str,
    created: int, *, chat: bool,
):  # fmt: skip
    common = {"rid": gens[0].call.rid, "model": state.model_name, "created": created,
              "id": cid}  # fmt: skip
    failed = False
    try:
        if chat:
            for i in range(len(gens)):
                yield P.sse(P.chat_first_chunk(index=i, **common))
        async for i, delta in merged_updates(gens):
            g = gens[i]
            if g.call is not None:
                g.call.started = True
            if delta is not None:
                if chat:
                    yield P.sse(P.chat_chunk(content=delta, index=i, **common))
                else:
                    yield P.sse(P.completion_chunk(text=delta, index=i, **common))
                continue
            err = g.failed
            if err is not None and not g.out_ids:
                yield P.sse_error(err)
                failed = True
                break
            comp = g.completion()
            if comp.finish is not None and comp.finish.kind == "abort":
                yield P.sse_error(P.finish_error(comp.finish))
                failed = True
                break
            if chat:
                yield P.sse(P.chat_chunk(content=None, finish=comp.finish, index=i, **common))
            else:
                yield P.sse(P.completion_chunk(text="", finish=comp.finish, index=i, **common))
        if not failed and req.include_usage:
            comps = [g.completion() for g in gens]
            use = P.usage(
                len(comps[0].prompt_ids),
                sum(len(c.output_ids) for c in comps),
                comps[0].cached_tokens,
            )
            make = P.chat_usage_chunk if chat else P.completion_usage_chunk
            yield P.sse(make(usage=use, **common))
        yield P.SSE_DONE
    finally:
        for g in gens:
            g.abort("client disconnected")
        done_all(state, gens, who)


def card(state: ServerState) -> dict[str, Any]:
    """The served model's ``/v1/models`` entry."""
    return P.models_response(state.model_name, max_model_len=state.limits.context_len)["data"][0]


async def models(state: ServerState, request: HTTPRequest) -> Response:
    return JSON({"object": "list", "data": [card(state)]})


async def model(state: ServerState, request: HTTPRequest) -> Response:
    """``GET /v1/models/{id}``: ids may hold slashes (Hugging Face ids). Any id is the
    served model (the rule the generation endpoints follow), reported by its name."""
    return JSON(card(state))


def openai_routes(state: ServerState) -> list[Route]:
    """The OpenAI-compatible routes over ``state``."""
    return [
        Route("/v1/completions", partial(completions, state), methods=["POST"]),
        Route("/v1/chat/completions", partial(chat_completions, state), methods=["POST"]),
        Route("/v1/models", partial(models, state), methods=["GET"]),
        Route("/v1/models/{model_id:path}", partial(model, state), methods=["GET"]),
    ]
