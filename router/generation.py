"""One prompt's life through the router: :class:`Generation`.

A :class:`Generation` submits its prompt to the router service, applies the stop strings, stop
ids and token limit to the tokens that come back, detokenizes them incrementally and builds
the :class:`~sgl_fair.router.protocol.Completion` the response is made of. A request's
generations, run from start to end, are in ``router/lifecycle.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sgl_fair.messages import FinishReason
from sgl_fair.request import Request
from sgl_fair.router import protocol as P
from sgl_fair.router.service import Call, NoWorkerError
from sgl_fair.router.state import Identity, ServerState
from sgl_fair.router.tokenizer import IncrementalDecoder

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
    differ from the defaults (None when all are defaults, so a plain request stays small),
    plus the keys passed through untouched (``engine_extra``: constrained decoding, ...)."""
    out: dict[str, Any] = {}
    for name, key in _ENGINE_SAMPLING.items():
        value = getattr(sp, name)
        if value != getattr(_SAMPLING_DEFAULTS, name):
            out[key] = list(value) if isinstance(value, tuple) else value
    if sp.engine_extra:
        out.update(sp.engine_extra)
    return out or None


def expand_samples(items: list[Any]) -> list[Any]:
    """Parallel samples: each item with ``sampling.n`` > 1 becomes ``n`` items (in order,
    the samples of one prompt together) with the same prompt, so they share its KV through
    the radix cache and are charged to the same tenant. A given ``rid`` gets ``-i``
    appended for sample ``i`` > 0 (SGLang's responses give each sample its own id)."""
    out = []
    for it in items:
        n = it.sampling.n
        if n <= 1:
            out.append(it)
            continue
        for i in range(n):
            rid = it.rid if it.rid is None or i == 0 else f"{it.rid}-{i}"
            out.append(dataclasses.replace(it, rid=rid))
    return out


class Generation:
    """One prompt through the router: stop conditions, detokenization, the final record."""

    def __init__(
        self,
        state: ServerState,
        item: Any,
        ids: list[int],
        max_new: int,
        who: Identity,
        sched: P.Scheduling | None = None,
    ) -> None:
        self.state = state
        self.item = item
        self.ids = ids
        self.who = who
        self.sched = sched if sched is not None else P.Scheduling()
        sp = item.sampling
        self.max_new = max_new  # clipped to the context
        self.stop = [s for s in (sp.stop or []) if s]
        # a stop string ending in newly added text starts at most this far before it
        self._stop_reach = max(map(len, self.stop), default=1) - 1
        self.stop_ids = set(sp.stop_token_ids or [])
        self.no_stop_trim = bool(getattr(sp, "no_stop_trim", False))
        self.decoder = IncrementalDecoder(state.tokenizer)
        self.out_ids: list[int] = []
        self.text = ""
        self.finish: P.FinishInfo | None = None
        self.call: Call | None = None
        self.t0 = time.time()
        # Parallel samples: a sample other than the first is submitted once its ``lead``
        # (the first) has prefilled the prompt, so it finds the prompt in the worker's radix
        # cache instead of prefilling it again in the same batch.
        self.lead: Generation | None = None
        self.submitted = asyncio.Event()
        self.start_error: P.ProtocolError | None = None
        self.aborted = False
        self._starter: asyncio.Future | None = None

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
            extra=item.extra,
            service_class=self.sched.service_class,
            ttft_slo_s=self.sched.ttft_slo_s,
            tpot_slo_s=self.sched.tpot_slo_s,
            interaction_id=self.sched.interaction_id,
            app=self.sched.app,
            stage=self.sched.stage,
            system_len=self.sched.system_len,
        )
        self.call = self.state.service.submit(req, self.who.client)
        if not self.call.done.is_set():  # else the router's cluster OIT refused it
            self.state.telemetry.submitted(self.who.client, self.sched.priority_class)
        self.submitted.set()

    async def start_after_lead(self) -> None:
        """Submit once the lead sample has its first token (its prompt is cached then)."""
        lead = self.lead
        assert lead is not None and lead.call is not None
        try:
            while not (lead.call.tokens or lead.call.done.is_set() or self.aborted):
                await asyncio.sleep(0.002)
            if not self.aborted:
                self.start()
        except NoWorkerError as e:
            self.start_error = P.ProtocolError(
                503, f"no worker available: {e}", None, retry_after_s=e.retry_after_s
            )
        finally:
            self.submitted.set()

    def _logprob_start(self) -> int:
        if not self.item.return_logprob:
            return -1
        start = self.item.logprob_start_len
        if start is None or start < 0:
            return -1
        return min(start, len(self.ids) - 1)

    def _take(self, new_ids: list[int]) -> str:
        """Accept new output tokens; returns the new text. Sets ``finish`` on a stop.

        With stop strings, each token is decoded and checked as it comes (as SGLang's
        scheduler does), so the output, and its token count, end at the token where a
        string matched, however many tokens the worker had sent in one update."""
        before = len(self.text)
        pending: list[int] = []  # accepted, decoded in one feed (no stop strings to check)
        for tok in new_ids:
            if len(self.out_ids) >= self.max_new:
                self.finish = P.FinishInfo("length", None, None)
                break
            self.out_ids.append(tok)
            if tok in self.stop_ids:
                self.finish = P.FinishInfo("stop", tok, None)
                break
            if not self.stop:
                pending.append(tok)
                continue
            start = len(self.text)
            self.text += self.decoder.feed([tok])
            if self._cut_at_stop(start):
                break
        if pending:
            self.text += self.decoder.feed(pending)
        if len(self.out_ids) >= self.max_new and self.finish is None:
            self.finish = P.FinishInfo("length", None, None)
        return self.text[before:] if len(self.text) >= before else ""

    def _cut_at_stop(self, start: int) -> bool:
        """If a stop string ends in the text added from ``start`` on, cut the text there
        (keeping the string with ``no_stop_trim``) and finish; the earliest match wins."""
        window_start = max(0, start - self._stop_reach)
        hit = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is None:
            return False
        i, s = hit
        self.text = self.text[: i + len(s)] if self.no_stop_trim else self.text[:i]
        self.finish = P.FinishInfo("stop", s, None)
        return True

    async def updates(self) -> AsyncIterator[str]:
        """Yield text deltas as tokens arrive; ends with ``self.finish`` set."""
        await self.submitted.wait()
        call = self.call
        if call is None:  # never submitted: aborted first, or no worker
            self.finish = P.FinishInfo("abort", None, "aborted before it started")
            return
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
        self.aborted = True
        if self.call is not None and not self.call.done.is_set():
            self.state.service.abort(self.call, reason)

    def completion_partial(self) -> P.Completion:
        """The request so far (a stream chunk): no finish, no logprobs yet."""
        call = self.call
        assert call is not None
        return P.Completion(
            rid=call.rid,
            prompt_ids=self.ids,
            output_ids=self.out_ids,  # not copied: a chunk is rendered at once
            text=self.text,
            e2e_s=time.time() - self.t0,
        )

    def completion(self) -> P.Completion:
        call = self.call
        assert call is not None and self.finish is not None
        fin = call.finished
        n = len(self.out_ids)
        in_lp = out_lp = top = in_top = None
        if self.item.return_logprob and fin is not None and fin.output_logprobs is not None:
            start = self._logprob_start()
            if fin.input_logprobs is not None and start >= 0:
                in_lp = list(zip(fin.input_logprobs, self.ids[start:], strict=False))
                if self.item.top_logprobs_num:
                    # one entry per prompt position, as SGLang returns; the engines report
                    # the prompt token's own logprob there, no alternatives (None: undefined)
                    in_top = [None if lp is None else [(lp, tid)] for lp, tid in in_lp]
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
            input_top_logprobs=in_top,
            extra_meta=(
                {"queue_time": fin.queue_s} if fin is not None and fin.queue_s is not None else None
            ),
        )

    @property
    def failed(self) -> P.ProtocolError | None:
        """The HTTP error for a generation that produced nothing because it failed."""
        call = self.call
        if call is None and self.start_error is not None:
            return self.start_error
        if call is None and self.aborted:
            return P.ProtocolError(499, "the request was aborted before it started", None)
        if call is None or call.finished is not None or call.error is None:
            fin = call.finished if call is not None else None
            if fin is not None and fin.reason is FinishReason.REJECTED:
                if fin.retry_after_s is not None:  # admission control: try again later
                    throttle = P.throttle_of(fin.limit)
                    if throttle is not None:  # FairServe's OIT: say which limit
                        return P.ProtocolError(
                            429, f"request throttled: {fin.error}", None,
                            retry_after_s=fin.retry_after_s,
                            details={"throttle": throttle.to_dict()},
                        )  # fmt: skip
                    return P.ProtocolError(
                        429, f"request refused by the scheduler: {fin.error}", None,
                        retry_after_s=fin.retry_after_s,
                    )  # fmt: skip
                return P.ProtocolError(400, f"request rejected by the scheduler: {fin.error}", None)
            return None
        status = call.error_status if call.error_status >= 500 else 503
        return P.ProtocolError(status, call.error, None)
