"""Admission: pulling waiting requests into the running set while they fit (SGLang's
``PrefillAdder``).

Room is measured live: ``available_tokens()`` already reflects this step's allocations and
the prefixes it locked (locking turns evictable tokens into locked ones), minus what the
running requests may still need (``reserved_tokens``: SGLang's new-token-ratio estimate) and
what this step promised to the requests it admitted. Allocation is check-then-commit.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

from sgl_fair.records import EventKind, ServiceEvent
from sgl_fair.request import Phase, Request
from sgl_fair.worker.engine import PrefillChunk
from sgl_fair.worker.kv.prefix_cache import PrefixHandle
from sgl_fair.worker.scheduler_state import SchedulerCore, without


class Admission:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    def reserved_tokens(self, req: Request | None = None) -> float:
        """KV the running requests may still need (SGLang's new-token-ratio estimate); with
        ``req``, only what is reserved against it (not the classes whose KV it overwrites)."""
        core = self.core
        clip = core.config.clip_max_new_tokens
        over = core.kv.overwrites(req) if req is not None else ()
        reserved = core.new_token_ratio * sum(
            min(r.remaining_new_tokens, clip)
            for r in core.running
            if not over or r.service_class.value not in over
        )
        if core.chunked is not None:
            c = core.chunked
            reserved += c.seq_len - c.num_computed + min(c.remaining_new_tokens, clip)
        return reserved

    def admit(
        self,
        budget: int,
        num_active: int,
        promised: int,
        walk: Iterator[Request] | None = None,
    ) -> list[PrefillChunk]:
        """Pull requests from ``walk`` (default: the policy's ``order``) while they fit within
        ``budget`` prefill tokens and the running-request limit; SGLang stops at the first
        that does not fit (then ``admission_blocked``). Returns the allocated, pinned chunks;
        at most one (the last) is partial and becomes ``chunked``."""
        core = self.core
        cfg = core.config
        clip = cfg.clip_max_new_tokens
        reserved_for: dict[frozenset, float] = {}  # by the classes a request may overwrite
        kv = core.kv
        promised += int(cfg.admission_watermark * kv.capacity_tokens)  # kept free (vLLM's)
        chunks: list[PrefillChunk] = []
        if walk is None:
            walk = core.policy.order(tuple(core.waiting), core)
        try:
            for req in walk:
                if budget <= 0:
                    break
                if num_active >= cfg.max_running_requests:
                    core.admission_blocked = True
                    break
                tokens = req.all_ids()
                reserve = min(req.remaining_new_tokens, clip)
                cached = min(core.prefix_len(req), len(tokens) - 1)
                over = kv.overwrites(req)
                if over not in reserved_for:
                    reserved_for[over] = self.reserved_tokens(req)
                reserved = reserved_for[over]
                if len(tokens) - cached + reserve > kv.available_tokens(req) - reserved - promised:
                    core.admission_blocked = True
                    break  # SGLang stops at the first request that does not fit
                handle = kv.acquire_prefix(tokens, limit=len(tokens) - 1)
                extend = len(tokens) - handle.prefix_len
                n = min(extend, budget)
                last = n == extend
                alloc = n + 1 if last else n
                room = kv.available_tokens(req) - reserved - promised  # after the lock
                if extend + reserve > room or not kv.can_allocate(req, alloc):
                    kv.tree.unlock(handle.node)
                    core.admission_blocked = True
                    break
                kv.allocate(req, alloc)
                kv.pin(req)  # a later admission this step must not overwrite its prefill
                self._on_admit(req, handle, extend)
                chunks.append(PrefillChunk(req, handle.prefix_len, n, last))
                if last:  # a chunked request's rest is reserved via `core.chunked`
                    promised += extend + reserve - alloc
                budget -= n
                num_active += 1
                if not last:
                    core.chunked = req
                    break
        finally:
            if isinstance(walk, Generator):  # run its cleanup now
                walk.close()
        if chunks:
            core.waiting = without(core.waiting, [c.req for c in chunks])
            memo = core.match_memo
            for chunk in chunks:
                memo.pop(chunk.req, None)
        return chunks

    def _on_admit(self, req: Request, handle: PrefixHandle, extend: int) -> None:
        core = self.core
        now = core.now
        first = req.num_retractions == 0
        req.phase = Phase.RUNNING
        if req.queued_s is not None:
            req.queue_s += max(now - req.queued_s, 0.0)
            req.queued_s = None
        req.prefix_len = handle.prefix_len
        req.num_computed = handle.prefix_len
        core.handles[req] = handle
        if first:
            req.first_prefix_len = handle.prefix_len
            req.admit_s = now
            core.log.events.append(
                ServiceEvent(now, req.client, req.rid, EventKind.PREFILL, req.input_len, extend)
            )
        core.policy.on_admitted(req, extend if first else 0)
