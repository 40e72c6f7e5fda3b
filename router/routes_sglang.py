"""SGLang-native generation: ``POST /generate`` (one prompt or a batch; SSE streaming with
SGLang's cumulative events; logprobs as ``sgl.select`` needs them)."""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sgl_fair.router import protocol as P
from sgl_fair.router.generation import Generation, done_all, prepare, until_done
from sgl_fair.router.http_io import JSON, read_json_body
from sgl_fair.router.state import Identity, ServerState


def sglang_routes(state: ServerState) -> list[Route]:
    """The SGLang-native generation route over ``state``."""
    tok = state.tokenizer
    limits = state.limits

    async def generate(request: HTTPRequest) -> Response:
        body = await read_json_body(request, state.cfg.max_body_bytes)
        req = P.parse_generate(body, limits)
        param = "input_ids" if req.items[0].input_ids is not None else "text"
        who, gens = prepare(state, request, req.items, param, None)
        if req.stream:
            return StreamingResponse(
                stream_generate(request, gens[0], who), media_type="text/event-stream"
            )
        await until_done(state, request, gens, who)
        outs = [
            P.generate_response(
                g.completion(),
                tokenizer=tok,
                return_text_in_logprobs=g.item.return_text_in_logprobs,
            )
            for g in gens
        ]
        return JSON(outs if req.is_batch else outs[0])

    async def stream_generate(request: HTTPRequest, g: Generation, who: Identity):
        interval = g.item.sampling.stream_interval
        sent = 0
        try:
            async for _delta in g.updates():
                g.call.started = True
                if len(g.out_ids) - sent < interval:
                    continue  # the final chunk below carries whatever is held back
                sent = len(g.out_ids)
                yield P.sse(
                    P.generate_chunk(
                        g.completion_partial(), tokenizer=tok,
                        return_text_in_logprobs=g.item.return_text_in_logprobs,
                    )
                )  # fmt: skip
            err = g.failed
            if err is not None and not g.out_ids:
                yield P.sse_error(err)
            else:
                yield P.sse(
                    P.generate_chunk(
                        g.completion(), tokenizer=tok,
                        return_text_in_logprobs=g.item.return_text_in_logprobs,
                    )
                )  # fmt: skip
            yield P.SSE_DONE
        finally:
            g.abort("client disconnected")
            done_all(state, [g], who)

    return [
        Route("/generate", generate, methods=["POST"]),
    ]
