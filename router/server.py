"""The HTTP front: SGLang-native and OpenAI-compatible APIs over the live router.

Starlette on uvicorn (uvloop + httptools). Why not FastAPI's pydantic models: every body is
parsed once with msgspec (``sgl_fair.router.protocol``), which is several times faster and
lets every error name the exact field (``sampling_params.max_new_tokens``); the routes are
few and fixed. Responses are encoded with msgspec as well.

Endpoints::

    POST /generate                 SGLang-native (text or input_ids, batches, SSE streaming,
                                   logprobs as sgl.select needs them, rid, routing_key)
    POST /v1/completions           OpenAI (+ streaming, usage)
    POST /v1/chat/completions      OpenAI (+ streaming, usage)
    GET  /v1/models, /get_model_info, /model_info, /server_info, /get_server_info
    GET  /health, /health_generate, /metrics (Prometheus)
    POST /flush_cache, /abort_request

Identity (``sgl_fair.config.identity_from_headers``): with a tenants file, the API key alone
names the tenant; otherwise X-Client-Id, then OpenAI's ``user``, then ``routing_key``.
Every failure is a JSON error in OpenAI's shape with the offending field; nothing is lost:
a client that disconnects has its request aborted on the worker (freeing its KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sgl_fair import config as tenants_mod
from sgl_fair.messages import FinishReason
from sgl_fair.request import Request
from sgl_fair.router import protocol as P
from sgl_fair.router.policies import make_router_policy
from sgl_fair.router.router import Router
from sgl_fair.router.service import Call, NoWorkerError, RouterService
from sgl_fair.router.telemetry import Telemetry
from sgl_fair.router.tokenizer import IncrementalDecoder, Tokenizer
from sgl_fair.transport import Endpoints

log = logging.getLogger("sgl_fair.server")

_json = msgspec.json.Encoder()


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def error_response(err: P.ProtocolError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        err.body(), status_code=err.status, media_type="application/json", headers=headers
    )


@dataclass
class ServerState:
    """Everything the handlers share: router service, tokenizer, tenants, limits."""

    cfg: Any  # LaunchConfig
    tokenizer: Tokenizer
    tenants: tenants_mod.TenantTable | None
    service: RouterService
    telemetry: Telemetry
    limits: P.Limits
    model_name: str
    kv_capacity_tokens: int
    url: str = ""
    worker_urls: list[str] = field(default_factory=list)  # --backend sglang: the servers
    started_s: float = field(default_factory=time.time)
    inflight: dict[str, int] = field(default_factory=dict)  # tenant -> calls in flight
    limiters: dict[str, Any] = field(default_factory=dict)  # tenant -> RateLimiter

    @classmethod
    def create(
        cls,
        cfg: Any,
        *,
        tokenizer: Tokenizer,
        tenants: tenants_mod.TenantTable | None,
        ipc_dir: str,
        kv_capacity_tokens: int,
        context_len: int,
        kv_endpoints: list[str] | None = None,
        worker_urls: list[str] | None = None,
        follow_kv_events: bool = True,
    ) -> ServerState:
        """``kv_capacity_tokens`` / ``context_len``: one worker's KV pool and the model's
        context, as the launcher knows them before the workers start (a real engine's numbers
        replace them: ``adopt_engine_limits``). ``kv_endpoints``: where each worker publishes
        its KV events (default: the sim workers' sockets in ``ipc_dir``). Without KV events
        (``follow_kv_events=False``) the router's tree also takes each finished request's
        output, as its best guess."""
        kv_cap = kv_capacity_tokens
        context = cfg.context_length or context_len
        router = Router(
            make_router_policy(cfg.router_policy, **cfg.router_policy_opts),
            cfg.dp,
            insert_outputs=not follow_kv_events,  # else the workers' KV events say it
            max_tree_tokens=cfg.max_tree_tokens,
        )
        telemetry = Telemetry()
        service = RouterService(
            router,
            Endpoints.ipc(ipc_dir),
            cfg.dp,
            telemetry=telemetry,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            kv_endpoints=kv_endpoints,
        )
        limiters = {}
        if tenants is not None:
            for t in tenants.tenants:
                limiter = t.make_limiter(time.monotonic())
                if limiter is not None:
                    limiters[t.name] = limiter
        name = cfg.served_model_name or cfg.model_path or cfg.model
        return cls(
            cfg=cfg,
            tokenizer=tokenizer,
            tenants=tenants,
            service=service,
            telemetry=telemetry,
            limits=P.Limits(context_len=min(context, kv_cap)),
            model_name=name,
            kv_capacity_tokens=kv_cap,
            worker_urls=list(worker_urls or []),
            limiters=limiters,
        )

    def adopt_engine_limits(self, *, context_len: int | None, model_name: str | None) -> None:
        """Real engines (``--backend sglang``): the KV capacity the workers reported in their
        ``Hello`` and the servers' context length replace the simulator's model. Call once
        every worker is ready, before the app is built."""
        caps = [w.kv_capacity_tokens for w in self.service.workers.values() if w.kv_capacity_tokens]
        if caps:
            self.kv_capacity_tokens = min(caps)
        context = self.cfg.context_length or context_len or self.limits.context_len
        self.limits = P.Limits(context_len=min(context, self.kv_capacity_tokens))
        if model_name and not (self.cfg.served_model_name or self.cfg.model_path):
            self.model_name = model_name

    def describe(self) -> str:
        cfg = self.cfg
        auth = f"{len(self.tenants.tenants)} tenants" if self.tenants else "no auth"
        if cfg.backend == "sglang":
            engines = sorted({w.engine for w in self.service.workers.values() if w.engine})
            engine = ", ".join(engines) or "sglang"
        else:
            speed = "zero-cost" if math.isinf(cfg.time_scale) else f"time-scale {cfg.time_scale:g}"
            engine = f"{cfg.backend} {cfg.gpu} {cfg.model} ({speed})"
        return (
            f"dp={cfg.dp} · {engine} · "
            f"router {cfg.router_policy} · local {cfg.schedule_policy} · {auth}"
        )


# ---------------------------------------------------------------------------- one generation

# SamplingParams field -> SGLang sampling_params key, for what the engine itself must apply.
# max_new_tokens travels as the request's own field; stop strings, detokenization options and
# stream_interval are the front's business (it detokenizes and streams).
_ENGINE_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_new_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "seed": "sampling_seed",
}
_SAMPLING_DEFAULTS = P.SamplingParams()


def engine_sampling(sp: P.SamplingParams) -> dict[str, Any] | None:
    """The sampling parameters a real engine applies, in SGLang's names; only those that
    differ from the defaults (None when all are defaults, so a plain request stays small)."""
    out: dict[str, Any] = {}
    for name, key in _ENGINE_SAMPLING.items():
        value = getattr(sp, name)
        if value != getattr(_SAMPLING_DEFAULTS, name):
            out[key] = list(value) if isinstance(value, tuple) else value
    return out or None


@dataclass
class Identity:
    client: str  # the scheduling identity (tenant name with keys)
    tenant: Any  # config.Tenant or None


class Generation:
    """One prompt through the router: stop conditions, detokenization, the final record."""

    def __init__(
        self, state: ServerState, item: Any, ids: list[int], max_new: int, who: Identity
    ) -> None:
        self.state = state
        self.item = item
        self.ids = ids
        self.who = who
        sp = item.sampling
        self.max_new = max_new  # clipped to the context
        self.stop = [s for s in (sp.stop or []) if s]
        self.stop_ids = set(sp.stop_token_ids or [])
        self.no_stop_trim = bool(getattr(sp, "no_stop_trim", False))
        self.decoder = IncrementalDecoder(state.tokenizer)
        self.out_ids: list[int] = []
        self.text = ""
        self.finish: P.FinishInfo | None = None
        self.call: Call | None = None
        self.t0 = time.time()

    def start(self) -> None:
        item = self.item
        rid = item.rid or uuid.uuid4().hex
        req = Request(
            rid=rid,
            client=self.who.client,
            input_ids=tuple(self.ids),
            output_len=max(self.max_new, 1),  # a prefill always samples one token
            arrival_s=self.t0,
            return_logprob=bool(item.return_logprob),
            logprob_start_len=self._logprob_start(),
            top_logprobs_num=item.top_logprobs_num or 0,
            sampling=engine_sampling(item.sampling),
        )
        self.call = self.state.service.submit(req, self.who.client)

    def _logprob_start(self) -> int:
        if not self.item.return_logprob:
            return -1
        start = self.item.logprob_start_len
        if start is None or start < 0:
            return -1
        return min(start, len(self.ids) - 1)

    def _take(self, new_ids: list[int]) -> str:
        """Accept new output tokens; returns the new text. Sets ``finish`` on a stop."""
        delta_ids = []
        for tok in new_ids:
            if len(self.out_ids) >= self.max_new:
                self.finish = P.FinishInfo("length", None, None)
                break
            self.out_ids.append(tok)
            if tok in self.stop_ids:
                self.finish = P.FinishInfo("stop", tok, None)
                break
            delta_ids.append(tok)
        before = len(self.text)
        self.text += self.decoder.feed(delta_ids)
        if self.stop and self.finish is None:
            longest = max(map(len, self.stop))
            window_start = max(0, before - longest + 1)
            hit = None
            for s in self.stop:
                i = self.text.find(s, window_start)
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self.text = self.text[: i + len(s)] if self.no_stop_trim else self.text[:i]
                self.finish = P.FinishInfo("stop", s, None)
        if len(self.out_ids) >= self.max_new and self.finish is None:
            self.finish = P.FinishInfo("length", None, None)
        return self.text[before:] if len(self.text) >= before else ""

    async def updates(self) -> AsyncIterator[str]:
        """Yield text deltas as tokens arrive; ends with ``self.finish`` set."""
        call = self.call
        assert call is not None
        seen = 0
        while True:
            await call.updated.wait()
            call.updated.clear()
            new = call.tokens[seen:]
            seen = len(call.tokens)
            had_finish = self.finish is not None
            delta = self._take(new) if new and not had_finish else ""
            if delta:
                yield delta
            if self.finish is not None and self.finish.kind == "stop":
                if not call.done.is_set():
                    self.state.service.abort(call, "stop")  # stop matched: free the worker now
                return
            if call.done.is_set():
                self._settle()
                return
            # finish == "length" before the worker's own end happens only for
            # max_new_tokens = 0 (the worker samples one token anyway): wait for its
            # Finished, which carries the logprobs and the cached-prefix length.

    def _settle(self) -> None:
        call = self.call
        assert call is not None
        if self.finish is not None:
            return
        fin = call.finished
        if fin is None:
            self.finish = P.FinishInfo("abort", None, call.error or "request failed")
        elif fin.reason is FinishReason.REJECTED:
            self.finish = P.FinishInfo("abort", None, fin.error or "rejected")
        elif fin.reason is FinishReason.ABORTED:
            self.finish = P.FinishInfo("abort", None, fin.error or "aborted")
        elif fin.reason is FinishReason.STOP:  # the engine's own stop: EOS or a stop token
            self.finish = P.FinishInfo("stop", self.out_ids[-1] if self.out_ids else None, None)
        else:
            self.finish = P.FinishInfo("length", None, None)

    def abort(self, reason: str) -> None:
        if self.call is not None and not self.call.done.is_set():
            self.state.service.abort(self.call, reason)

    def completion_partial(self) -> P.Completion:
        """The request so far (a stream chunk): no finish, no logprobs yet."""
        call = self.call
        assert call is not None
        return P.Completion(
            rid=call.rid,
            prompt_ids=self.ids,
            output_ids=list(self.out_ids),
            text=self.text,
            e2e_s=time.time() - self.t0,
        )

    def completion(self) -> P.Completion:
        call = self.call
        assert call is not None and self.finish is not None
        fin = call.finished
        n = len(self.out_ids)
        in_lp = out_lp = top = None
        if self.item.return_logprob and fin is not None and fin.output_logprobs is not None:
            start = self._logprob_start()
            if fin.input_logprobs is not None and start >= 0:
                in_lp = list(zip(fin.input_logprobs, self.ids[start:], strict=False))
            out_lp = list(zip(fin.output_logprobs[:n], self.out_ids, strict=False))
            if fin.output_top_logprobs:
                top = [list(row) for row in fin.output_top_logprobs[:n]]
        return P.Completion(
            rid=call.rid,
            prompt_ids=self.ids,
            output_ids=list(self.out_ids),
            text=self.text,
            finish=self.finish,
            cached_tokens=fin.prefix_len if fin is not None else 0,
            e2e_s=time.time() - self.t0,
            input_logprobs=in_lp,
            output_logprobs=out_lp,
            output_top_logprobs=top,
        )

    @property
    def failed(self) -> P.ProtocolError | None:
        """The HTTP error for a generation that produced nothing because it failed."""
        call = self.call
        if call is None or call.finished is not None or call.error is None:
            fin = call.finished if call is not None else None
            if fin is not None and fin.reason is FinishReason.REJECTED:
                if fin.retry_after_s is not None:  # admission control: try again later
                    return P.ProtocolError(
                        429, f"request refused by the scheduler: {fin.error}", None,
                        retry_after_s=fin.retry_after_s,
                    )  # fmt: skip
                return P.ProtocolError(400, f"request rejected by the scheduler: {fin.error}", None)
            return None
        status = call.error_status if call.error_status >= 500 else 503
        return P.ProtocolError(status, call.error, None)


# ---------------------------------------------------------------------------- the app


def build_app(
    state: ServerState,
    *,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> Starlette:
    svc = state.service
    tok = state.tokenizer
    limits = state.limits

    async def read_json_body(request: HTTPRequest) -> bytes:
        limit = state.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise P.ProtocolError(413, f"request body is larger than {limit} bytes", None)
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise P.ProtocolError(413, f"request body is larger than {limit} bytes", None)
            chunks.append(chunk)
        return b"".join(chunks)

    def identify(request: HTTPRequest, user: str | None, routing_key: str | None) -> Identity:
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            client, tenant = tenants_mod.identity_from_headers(
                state.tenants, headers, user, routing_key
            )
        except tenants_mod.AuthError as e:
            raise P.ProtocolError(401, str(e), None) from None
        except tenants_mod.BadClientId as e:
            raise P.ProtocolError(400, str(e), None) from None
        return Identity(client, tenant)

    def admit(who: Identity, n: int) -> None:
        """Tenant limits: requests per minute and requests in flight (HTTP 429)."""
        t = who.tenant
        if t is None:
            return
        limiter = state.limiters.get(t.name)
        if limiter is not None:
            wait = None
            for _ in range(n):
                wait = limiter.try_acquire(time.monotonic())
                if wait is not None:
                    break
            if wait is not None:
                state.telemetry.rejected(who.client, "rpm")
                raise P.ProtocolError(
                    429, f"tenant {t.name!r} is over its rate limit of {t.rpm} requests/min",
                    None, retry_after_s=wait,
                )  # fmt: skip
        cap = t.max_inflight
        if cap is not None and state.inflight.get(t.name, 0) + n > cap:
            state.telemetry.rejected(who.client, "max_inflight")
            raise P.ProtocolError(
                429, f"tenant {t.name!r} already has {state.inflight.get(t.name, 0)} requests "
                f"in flight (max_inflight = {cap})", None, retry_after_s=1.0,
            )  # fmt: skip

    def tokenize(
        item: Any, param: str, who: Identity, *, chat: bool = False
    ) -> tuple[list[int], int]:
        """Prompt ids and the max_new_tokens that fits the context (SGLang clips it)."""
        if item.input_ids is not None:
            ids = list(item.input_ids)
            P.check_ids(ids, tok.vocab_size, param)
        else:
            ids = tok.encode(item.text, add_special_tokens=not chat)
            if not ids:
                raise P.ProtocolError(400, f"{param} is empty after tokenization", param)
        max_new = P.check_prompt_length(len(ids), item.sampling.max_new_tokens, limits, param)
        if item.return_logprob and item.logprob_start_len >= 0:
            P.check_logprob_start_len(item.logprob_start_len, len(ids))
        t = who.tenant
        cap = getattr(t, "max_input_tokens", None) if t is not None else None
        if cap is not None and len(ids) > cap:
            raise P.ProtocolError(
                400, f"{param} has {len(ids)} tokens; tenant limit is {cap}", param
            )
        return ids, max_new

    def start_all(gens: list[Generation], who: Identity) -> None:
        started: list[Generation] = []
        try:
            for g in gens:
                if g.item.rid is not None and g.item.rid in svc.calls:
                    raise P.ProtocolError(400, f"rid {g.item.rid!r} is already in flight", "rid")
                g.start()
                started.append(g)
        except NoWorkerError as e:
            for g in started:
                g.abort("no worker")
            raise P.ProtocolError(503, f"no worker available: {e}", None) from None
        except P.ProtocolError:
            for g in started:
                g.abort("batch refused")
            raise
        key = who.tenant.name if who.tenant is not None else None
        if key is not None:
            state.inflight[key] = state.inflight.get(key, 0) + len(gens)

    def done_all(gens: list[Generation], who: Identity) -> None:
        key = who.tenant.name if who.tenant is not None else None
        if key is not None:
            state.inflight[key] = max(0, state.inflight.get(key, 0) - len(gens))

    async def run_to_end(request: HTTPRequest, gens: list[Generation]) -> None:
        """Wait for every generation; abort them all if the client goes away."""

        async def one(g: Generation) -> None:
            async for _ in g.updates():
                pass

        task = asyncio.gather(*(one(g) for g in gens))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    task.result()
                    return
                if await request.is_disconnected():
                    for g in gens:
                        g.abort("client disconnected")
                    await task
                    return
        except asyncio.CancelledError:
            for g in gens:
                g.abort("client disconnected")
            raise

    def prepare(
        request: HTTPRequest, items: list[Any], param: str, user: str | None, *, chat: bool = False
    ) -> tuple[Identity, list[Generation]]:
        who = identify(request, user, items[0].routing_key)
        gens = []
        for it in items:
            ids, max_new = tokenize(it, param, who, chat=chat)
            gens.append(Generation(state, it, ids, max_new, who))
        admit(who, len(gens))
        start_all(gens, who)
        return who, gens

    def check_failed(gens: list[Generation]) -> None:
        for g in gens:
            err = g.failed
            if err is not None:
                raise err

    async def until_done(request: HTTPRequest, gens: list[Generation], who: Identity) -> None:
        """A non-streaming response: wait for every generation, raise the first failure."""
        try:
            await run_to_end(request, gens)
        finally:
            done_all(gens, who)
        check_failed(gens)

    def openai_stream(
        request: HTTPRequest, g: Generation, who: Identity, req: Any, cid: str, created: int,
        *, chat: bool,
    ) -> StreamingResponse:  # fmt: skip
        return StreamingResponse(
            stream_openai(request, g, who, req, cid, created, chat=chat),
            media_type="text/event-stream",
        )

    # ---- SGLang-native ------------------------------------------------------------------------

    async def generate(request: HTTPRequest) -> Response:
        body = await read_json_body(request)
        req = P.parse_generate(body, limits)
        param = "input_ids" if req.items[0].input_ids is not None else "text"
        who, gens = prepare(request, req.items, param, None)
        if req.stream:
            return StreamingResponse(
                stream_generate(request, gens[0], who), media_type="text/event-stream"
            )
        await until_done(request, gens, who)
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
            done_all([g], who)

    # ---- OpenAI -------------------------------------------------------------------------------

    def check_model(model: str | None) -> None:
        if model is not None and model not in (state.model_name, "default"):
            raise P.ProtocolError(
                404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                "model",
            )  # fmt: skip

    async def completions(request: HTTPRequest) -> Response:
        body = await read_json_body(request)
        req = P.parse_completion(body, limits)
        check_model(req.model)
        param = "prompt"
        who, gens = prepare(request, req.items, param, req.user)
        created = int(time.time())
        cid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return openai_stream(request, gens[0], who, req, cid, created, chat=False)
        await until_done(request, gens, who)
        return JSON(
            P.completion_response(
                [g.completion() for g in gens], model=state.model_name, created=created,
                tokenizer=tok, echo=req.echo, logprobs=req.logprobs, id=cid,
            )
        )  # fmt: skip

    async def chat_completions(request: HTTPRequest) -> Response:
        body = await read_json_body(request)
        req = P.parse_chat(body, limits)
        check_model(req.model)
        item = req.item_for(P.render_chat_prompt(req, tok))
        who, gens = prepare(request, [item], "messages", req.user, chat=True)
        created = int(time.time())
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return openai_stream(request, gens[0], who, req, cid, created, chat=True)
        await until_done(request, gens, who)
        return JSON(
            P.chat_response(
                gens[0].completion(), model=state.model_name, created=created, tokenizer=tok,
                logprobs=bool(req.logprobs), id=cid,
            )
        )  # fmt: skip

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
            done_all([g], who)

    async def models(request: HTTPRequest) -> Response:
        return JSON(P.models_response(state.model_name))

    # ---- info, health, admin -------------------------------------------------------------------

    async def get_model_info(request: HTTPRequest) -> Response:
        return JSON(
            P.model_info(
                state.model_name,
                tokenizer_path=tok.name,
                served_model_name=state.model_name,
                context_length=limits.context_len,
                max_total_num_tokens=state.kv_capacity_tokens,
            )
        )

    def server_info_dict() -> dict[str, Any]:
        cfg = state.cfg
        router = svc.router
        held = router.tree.tokens_by_worker()
        workers = []
        for w in svc.workers.values():
            load = router.load(w.wid)
            workers.append(
                {
                    "id": w.wid,
                    "alive": w.alive,
                    "pid": w.pid,
                    "engine": w.engine,
                    "death": w.death,
                    "queue_len": router.queue_len(w.wid),
                    "num_waiting": load.num_waiting if load else None,
                    "num_running": load.num_running if load else None,
                    "kv_used_tokens": load.kv_used_tokens if load else None,
                    "kv_cached_tokens": load.kv_cached_tokens if load else None,
                    "kv_capacity_tokens": w.kv_capacity_tokens,
                    "kv_event_gaps": w.kv_gaps,
                    "kv_orphans": w.decoder.num_orphans,
                    "tree_tokens": held.get(w.wid, 0),
                    "kv_events": router.stats[w.wid].num_kv_events,
                    **({"url": state.worker_urls[w.wid]} if state.worker_urls else {}),
                }
            )
        tenants = None
        if state.tenants is not None:
            tenants = [{"name": t.name, "weight": t.weight} for t in state.tenants.tenants]
        return {
            "version": "sgl-fair 0.1.0",
            "model_path": state.model_name,
            "served_model_name": state.model_name,
            "dp_size": cfg.dp,
            "backend": cfg.backend,
            "gpu": cfg.gpu,
            "model": cfg.model,
            "time_scale": None if math.isinf(cfg.time_scale) else cfg.time_scale,
            "schedule_policy": cfg.schedule_policy,
            "schedule_policy_opts": cfg.schedule_policy_opts,
            "router_policy": cfg.router_policy,
            "router_policy_opts": cfg.router_policy_opts,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "max_running_requests": cfg.max_running_requests,
            "context_length": limits.context_len,
            "kv_page_size": cfg.kv_page_size,
            "tokenizer": tok.name,
            "auth": state.tenants is not None and state.tenants.requires_auth,
            "tenants": tenants,
            "workers": workers,
            "in_flight": len(svc.calls),
            "redispatched": svc.num_redispatched,
            "failed_by_worker_death": svc.num_failed_by_death,
            "uptime_s": round(time.time() - state.started_s, 3),
        }

    async def server_info(request: HTTPRequest) -> Response:
        return JSON(server_info_dict())

    async def health(request: HTTPRequest) -> Response:
        if svc.router.workers:
            return Response(b"", status_code=200)
        return error_response(P.ProtocolError(503, "no worker is alive", None))

    async def health_generate(request: HTTPRequest) -> Response:
        item = P.parse_generate(
            b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', limits
        ).items[0]
        g = Generation(state, item, [1], 1, Identity("health", None))
        try:
            g.start()
        except NoWorkerError:
            return error_response(P.ProtocolError(503, "no worker is alive", None))
        try:
            await asyncio.wait_for(run_to_end(request, [g]), 20.0)
        except asyncio.TimeoutError:
            g.abort("health check timed out")
            return error_response(P.ProtocolError(503, "generation timed out", None))
        if g.failed is not None:
            return error_response(P.ProtocolError(503, str(g.failed.message), None))
        return Response(b"", status_code=200)

    def require_admin(request: HTTPRequest) -> Identity:
        who = identify(request, None, None)
        keyed = state.tenants is not None and state.tenants.requires_auth
        if keyed and not getattr(who.tenant, "admin", False):
            raise P.ProtocolError(
                403, f"tenant {who.client!r} may not do this (needs admin = true)", None
            )
        return who

    async def flush_cache(request: HTTPRequest) -> Response:
        require_admin(request)
        answers = await svc.flush_cache()
        refused = sorted(w for w, ok in answers.items() if not ok)
        if refused:
            return error_response(
                P.ProtocolError(
                    400, f"cache not flushed on workers {refused}: requests are in flight", None
                )
            )
        return Response(b"Cache flushed.\n", status_code=200, media_type="text/plain")

    async def abort_request(request: HTTPRequest) -> Response:
        body = await read_json_body(request)
        try:
            obj = msgspec.json.decode(body or b"{}")
        except msgspec.DecodeError as e:
            raise P.ProtocolError(400, f"request body is not valid JSON: {e}", None) from None
        if not isinstance(obj, dict):
            raise P.ProtocolError(400, "request body must be a JSON object", None)
        rid = obj.get("rid")
        abort_all = obj.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise P.ProtocolError(400, "abort_all must be a boolean", "abort_all")
        if rid is not None and not isinstance(rid, str):
            raise P.ProtocolError(400, "rid must be a string", "rid")
        if rid is None and not abort_all:
            raise P.ProtocolError(400, "give a rid or abort_all = true", "rid")
        who = identify(request, None, None)
        keyed = state.tenants is not None and state.tenants.requires_auth
        admin = bool(getattr(who.tenant, "admin", False))
        n = 0
        for call in list(svc.calls.values()):
            if not abort_all and call.rid != rid:
                continue
            if keyed and not admin and call.tenant != who.client:
                continue  # a tenant may abort only its own requests
            svc.abort(call, "aborted by /abort_request")
            n += 1
        return JSON({"aborted": n})

    async def metrics(request: HTTPRequest) -> Response:
        return Response(state.telemetry.render(), media_type=state.telemetry.content_type)

    # ---- errors --------------------------------------------------------------------------------

    async def on_protocol_error(request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, P.ProtocolError)
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return error_response(exc, headers)

    async def on_http_error(request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        if status == 404:
            msg = f"no such endpoint: {request.method} {request.url.path}"
        elif status == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(P.ProtocolError(status, msg, None))

    async def on_error(request: HTTPRequest, exc: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return error_response(P.ProtocolError(500, f"internal error: {type(exc).__name__}", None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/model_info", get_model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={
            P.ProtocolError: on_protocol_error,
            HTTPException: on_http_error,
            Exception: on_error,
        },
        lifespan=lifespan,
    )
