"""OpenAI-compatible endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (each
with SSE streaming and ``stream_options.include_usage``) and ``GET /v1/models``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sgl_fair.router import protocol as P
from sgl_fair.router.generation import Generation, done_all, prepare, until_done
from sgl_fair.router.http_io import JSON, read_json_body
from sgl_fair.router.state import Identity, ServerState


def openai_routes(state: ServerState) -> list[Route]:
    """The OpenAI-compatible routes over ``state``."""
    tok = state.tokenizer
    limits = state.limits

    def check_model(model: str | None) -> None:
        if model is not None and model not in (state.model_name, "default"):
            raise P.ProtocolError(
                404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                "model",
            )  # fmt: skip

    async def completions(request: HTTPRequest) -> Response:
        body = await read_json_body(request, state.cfg.max_body_bytes)
        req = P.parse_completion(body, limits)
        check_model(req.model)
        param = "prompt"
        who, gens = prepare(state, request, req.items, param, req.user)
        created = int(time.time())
        cid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return openai_stream(request, gens[0], who, req, cid, created, chat=False)
        await until_done(state, request, gens, who)
        return JSON(
            P.completion_response(
                [g.completion() for g in gens], model=state.model_name, created=created,
                tokenizer=tok, echo=req.echo, logprobs=req.logprobs, id=cid,
            )
        )  # fmt: skip

    async def chat_completions(request: HTTPRequest) -> Response:
        body = await read_json_body(request, state.cfg.max_body_bytes)
        req = P.parse_chat(body, limits)
        check_model(req.model)
        item = req.item_for(P.render_chat_prompt(req, tok))
        who, gens = prepare(state, request, [item], "messages", req.user, chat=True)
        created = int(time.time())
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return openai_stream(request, gens[0], who, req, cid, created, chat=True)
        await until_done(state, request, gens, who)
        return JSON(
            P.chat_response(
                gens[0].completion(), model=state.model_name, created=created, tokenizer=tok,
                logprobs=bool(req.logprobs), id=cid,
            )
        )  # fmt: skip

    def openai_stream(
        request: HTTPRequest, g: Generation, who: Identity, req: Any, cid: str, created: int,
        *, chat: bool,
    ) -> StreamingResponse:  # fmt: skip
        return StreamingResponse(
            stream_openai(request, g, who, req, cid, created, chat=chat),
            media_type="text/event-stream",
        )

    async def stream_openai(
        request: HTTPRequest, g: Generation, who: Identity, req: Any, cid: str, created: int,
        *, chat: bool,
    ):  # fmt: skip
        common = {"rid": g.call.rid, "model": state.model_name, "created": created, "id": cid}
        try:
            if chat:
                yield P.sse(P.chat_first_chunk(**common))
            async for delta in g.updates():
                g.call.started = True
                if chat:
                    yield P.sse(P.chat_chunk(content=delta, **common))
                else:
                    yield P.sse(P.completion_chunk(text=delta, **common))
            err = g.failed
            comp = g.completion()
            if err is not None and not g.out_ids:
                yield P.sse_error(err)
            elif comp.finish is not None and comp.finish.kind == "abort":
                yield P.sse_error(P.finish_error(comp.finish))
            else:
                if chat:
                    yield P.sse(P.chat_chunk(content=None, finish=comp.finish, **common))
                else:
                    yield P.sse(P.completion_chunk(text="", finish=comp.finish, **common))
                if req.include_usage:
                    use = P.usage(len(comp.prompt_ids), len(comp.output_ids), comp.cached_tokens)
                    make = P.chat_usage_chunk if chat else P.completion_usage_chunk
                    yield P.sse(make(usage=use, **common))
            yield P.SSE_DONE
        finally:
            g.abort("client disconnected")
            done_all(state, [g], who)

    async def models(request: HTTPRequest) -> Response:
        return JSON(P.models_response(state.model_name))

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
