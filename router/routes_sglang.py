"""SGLang-native generation: ``POST /generate`` (one prompt or a batch; SSE streaming with
SGLang's cumulative events; logprobs as ``sgl.select`` needs them; ``sampling_params.n``
parallel samples, streamed with each event's ``index``)."""

from __future__ import annotations

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


def result(state: ServerState, g: Generation, c: P.Completion, index: int | None) -> dict[str, Any]:
    """One generation's ``/generate`` result (or stream event), SGLang's shape."""
    out = P.generate_response(
        c, tokenizer=state.tokenizer, return_text_in_logprobs=g.item.return_text_in_logprobs
    )
    if g.item.return_prompt_token_ids:
        out["prompt_token_ids"] = list(g.ids)
    out["meta_info"]["priority_class"] = g.sched.priority_class  # the class sent to the worker
    if index is not None:
        out["index"] = index
    return out


async def generate(state: ServerState, request: HTTPRequest) -> Response:
    body = await read_json_body(request, state.cfg.max_body_bytes)
    req = P.parse_generate(body, state.limits, state.features)
    param = "input_ids" if req.items[0].input_ids is not None else "text"
    who, gens = prepare(state, request, req.items, param, None)
    if req.stream:
        await first_events(state, request, gens, who)  # refused before a token: its status
        return StreamingResponse(stream_generate(state, gens, who), media_type="text/event-stream")
    await until_done(state, request, gens, who)
    outs = [result(state, g, g.completion(), None) for g in gens]
    # SGLang answers a list for a batch and for n > 1 samples of one prompt
    return JSON(outs if req.is_batch or len(gens) > 1 else outs[0])


async def stream_generate(state: ServerState, gens: list[Generation], who: Identity):
    many = len(gens) > 1
    sent = [0] * len(gens)
    try:
        async for i, delta in merged_updates(gens):
            g = gens[i]
            if g.call is not None:
                g.call.started = True
            index = i if many else None
            if delta is None:  # this sample is done: its final event
                err = g.failed
                if err is not None and not g.out_ids:
                    yield P.sse_error(err)
                else:
                    yield P.sse(result(state, g, g.completion(), index))
                continue
            if len(g.out_ids) - sent[i] < g.item.sampling.stream_interval:
                continue  # the final event carries whatever is held back
            sent[i] = len(g.out_ids)
            yield P.sse(result(state, g, g.completion_partial(), index))
        yield P.SSE_DONE
    finally:
        for g in gens:
            g.abort("client disconnected")
        done_all(state, gens, who)


def sglang_routes(state: ServerState) -> list[Route]:
    """The SGLang-native generation route over ``state``."""
    return [
        Route("/generate", partial(generate, state), methods=["POST"]),
    ]
