"""The worker's continuous-batching scheduler: pure, clock-agnostic, engine-agnostic.

One step, mirroring SGLang's ``get_next_batch_to_run``::

    waiting ──policy.order──▶ admit while it fits ──▶ prefill batch   (priority)
                                  │ nothing admissible
                                  ▼
    running ─────────────────────────────────────▶ decode batch (+1 token each)
                                  │ out of KV memory
                                  ▼
                      retract requests back to waiting

Admission is bounded by ``max_running_requests``, a per-step prefill token budget
(``chunked_prefill_size``; a prompt larger than what is left is chunked, one
chunked request at a time) and KV memory: cached prefixes are shared through the
radix tree, and running requests reserve room for their future output scaled by
the *new-token ratio* (SGLang's optimistic estimate, decayed each decode step and
raised after a retraction). Allocation is check-then-commit: tokens a step needs
are allocated in ``step`` so ``apply`` never fails.

Batch selection (seam #1b): a policy with ``select_batch(candidates, view, cost)`` chooses
the iteration's running set from waiting + running (BROS; ``select_step.py``), priced by
the iteration cost model ``cost`` (``IterationCost``). Liveness — never idle with work —
is ``scheduler_liveness.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace

from sgl_fair.policies.base import Policy, PolicyCaps, Rejection
from sgl_fair.radix import MatchMemo
from sgl_fair.records import EventKind, ServiceEvent
from sgl_fair.request import Phase, Request
from sgl_fair.worker import share_guard
from sgl_fair.worker.engine import Batch, PrefillChunk, StepResult
from sgl_fair.worker.kv.base import OutOfMemory
from sgl_fair.worker.kv.prefix_cache import PrefixHandle, PrefixKVCache
from sgl_fair.worker.scheduler_liveness import continue_chunked, unjam
from sgl_fair.worker.scheduler_state import (  # re-exported: their home for callers
    RunLog,
    SchedulerConfig,
    SchedulerStats,
    enqueue,
    without,
)
from sgl_fair.worker.scheduler_view import SchedulerViewMixin
from sgl_fair.worker.select_step import decode_restoring, restore_checkpointed, step_selected

__all__ = ["IterationCost", "RunLog", "Scheduler", "SchedulerConfig", "SchedulerStats"]

# Seconds for one iteration: prefill chunks ``(num_new_tokens, num_context_before)`` and one
# decode token per context length (the signature of ``sim.CostModel.step_time``).
IterationCost = Callable[..., float]

_DECODE = EventKind.DECODE  # one per generated token: looked up once


class Scheduler(SchedulerViewMixin):
    def __init__(
        self,
        *,
        policy: Policy,
        kv: PrefixKVCache,
        config: SchedulerConfig | None = None,
        log: RunLog | None = None,
        cost: IterationCost | None = None,
    ) -> None:
        self.policy = policy
        self.policy_caps = caps = PolicyCaps.of(policy)  # checked once: never probed again
        self.cost = cost  # the iteration cost model, for batch-selecting policies
        self.kv = kv
        # Block allocators: decode growth is checked per request (a token count cannot say
        # whether a block is free), and checkpointed KV (bidirectional) is restored first.
        self._checkpointing = kv.per_request_growth
        # Optional seam: a policy that throttles only under overload (FairServe's OIT) reads
        # the worker's KV usage through this probe.
        if caps.attach_load is not None:
            caps.attach_load(self.kv_usage)
        self.config = config or SchedulerConfig()
        self.log = log if log is not None else RunLog()
        self.stats = SchedulerStats()
        self.waiting: list[Request] = []  # arrival order
        self.running: list[Request] = []  # prefilled, decoding
        self.chunked: Request | None = None  # admitted, prompt partly computed
        self.new_token_ratio = self.config.init_new_token_ratio
        self._handles: dict[Request, PrefixHandle] = {}
        self._now = 0.0
        # Waiting request -> memoized prefix match (valid until its tree path changes).
        self._match_memo: dict[Request, MatchMemo] = {}
        # SGLang's `batch_is_full`: the last walk stopped for lack of memory or running
        # slots, so skip walking (O(waiting)) until a request finishes, is retracted or
        # arrives. Decode steps run meanwhile, so this never idles the worker.
        self._admission_blocked = False
        self._blocked_decode_steps = 0
        # Requests whose prefill is in the batch between step() and apply().
        self._in_batch: tuple[Request, ...] = ()
        self._restored_tokens = 0  # KV a continued chunk got back from host, this step

    # ------------------------------------------------------------ arrivals

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_active(self) -> int:
        """Requests holding KV for computation: running, being prefilled, or chunked."""
        active = {id(r) for r in self.running}
        active.update(id(r) for r in self._in_batch)
        if self.chunked is not None:
            active.add(id(self.chunked))
        return len(active)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def add_request(self, req: Request, now: float) -> Rejection | None:
        """Queue a request, or reject it (returned and logged) if it can never run here."""
        self._now = now
        need = req.input_len + req.max_new_tokens
        if need > self.kv.capacity_tokens:
            rejection = Rejection(
                f"request needs {need} KV tokens (input {req.input_len} + max_new_tokens "
                f"{req.max_new_tokens}) but the pool holds {self.kv.capacity_tokens}"
            )
        else:
            rejection = self.policy.on_arrival(req, now)
        if rejection is not None:
            req.phase = Phase.REJECTED
            req.reject_reason = rejection.reason
            req.reject_retry_after_s = rejection.retry_after_s
            if rejection.limit is not None:
                req.reject_limit = (
                    rejection.limit,
                    rejection.limit_max or 0,
                    rejection.limit_window_s or 0.0,
                )
            self.log.done.append(req)
            return rejection
        req.phase = Phase.WAITING
        req.queued_s = now
        self._enqueue(req)
        self._admission_blocked = False
        return None

    def _enqueue(self, req: Request) -> None:
        enqueue(self.waiting, req)

    def abort(self, req: Request, now: float, reason: str = "aborted") -> bool:
        """Cancel ``req`` wherever it is (waiting, running or mid-chunked-prefill).

        Must be called between steps (never between ``step`` and its ``apply``). Computed
        KV is kept in the prefix cache, as SGLang does for an aborted request; what the
        client was charged stays charged. Returns False if ``req`` is not here (finished
        already, or never added): aborting is idempotent.
        """
        if self._in_batch:
            raise RuntimeError("abort() between step() and apply()")
        self._now = now
        if req.phase is Phase.WAITING and req in self.waiting:
            self.waiting.remove(req)
            self._match_memo.pop(req, None)
            waiting = True
        elif req.phase is Phase.RUNNING and (req is self.chunked or req in self.running):
            if req is self.chunked:
                self.chunked = None
            else:
                self.running.remove(req)
            handle = self._handles.pop(req)
            computed = req.all_ids()[: req.num_computed]
            # Keep its KV in the cache, unless part of it is checkpointed to host (a paused BE
            # request under bidirectional blocks): then it is dropped, host copy included.
            if len(computed) > handle.prefix_len and not self.checkpointed_slots(req):
                handle = self.kv.commit(req, computed, handle)
            self.kv.release(req, handle)
            waiting = False
        else:
            return False
        self.kv.forget(req)
        req.phase = Phase.ABORTED
        req.abort_reason = reason
        req.finish_s = now
        self._admission_blocked = False
        self.log.done.append(req)
        self.policy.on_aborted(req, waiting)
        return True

    # ------------------------------------------------------------ step

    def step(self, now: float) -> Batch | None:
        """The next batch to run, or None when there is nothing to do (never while there is
        work: ``scheduler_liveness.unjam``)."""
        self._now = now
        batch = self._next_batch()
        if batch is None and self.has_work():
            batch = unjam(self, self._next_batch)
        if batch is not None and self._restored_tokens:
            batch = replace(batch, swap_in_tokens=batch.swap_in_tokens + self._restored_tokens)
            self._restored_tokens = 0
        return batch

    def _next_batch(self) -> Batch | None:
        self.kv.unpin_all()  # what the last step prefilled may be overwritten again
        select = self.policy_caps.select_batch
        if select is not None:
            return step_selected(self, select)
        every = self.config.recheck_blocked_every
        if self._admission_blocked and every and self._blocked_decode_steps >= every:
            self._admission_blocked = False
        if self.chunked is not None or (self.waiting and not self._admission_blocked):
            batch = self._schedule_prefill()
            if batch is not None:
                self.stats.num_prefill_steps += 1
                self.stats.num_prefill_tokens += batch.num_prefill_tokens
                return batch
        if self.running:
            self._ensure_decode_memory()
            swap_in = 0
            if self._checkpointing:  # bidirectional blocks: restore paused BE KV first
                decode, swap_in = decode_restoring(self)
                if not decode:  # nothing could grow, all retracted: try admitting
                    return None
            else:
                decode = self.running
                done = self.kv.allocate_each(decode)
                if done < len(decode):  # _ensure_decode_memory left too little: a bug
                    raise OutOfMemory(f"no KV for the next token of {decode[done]!r}")
            self._blocked_decode_steps = (
                self._blocked_decode_steps + 1 if self._admission_blocked else 0
            )
            self.stats.num_decode_steps += 1
            return Batch(decode=tuple(decode), swap_in_tokens=swap_in, kv_copies=self._copies())
        self.new_token_ratio = self.config.init_new_token_ratio
        return None

    def _reserved_tokens(self, req: Request | None = None) -> float:
        """KV the running requests may still need (SGLang's new-token-ratio estimate); with
        ``req``, only what is reserved against it (not the classes whose KV it overwrites)."""
        clip = self.config.clip_max_new_tokens
        over = self.kv.overwrites(req) if req is not None else ()
        reserved = self.new_token_ratio * sum(
            min(r.remaining_new_tokens, clip)
            for r in self.running
            if not over or r.service_class.value not in over
        )
        if self.chunked is not None:
            c = self.chunked
            reserved += c.seq_len - c.num_computed + min(c.remaining_new_tokens, clip)
        return reserved

    def _schedule_prefill(self) -> Batch | None:
        cfg = self.config
        budget = cfg.chunked_prefill_size
        chunks: list[PrefillChunk] = []
        # KV promised to requests of this batch but not allocated yet (their future output).
        promised = 0
        if self.chunked is not None:
            chunk = continue_chunked(self, budget)
            if chunk is None:
                return None
            chunks.append(chunk)
            budget -= chunk.num_tokens
            if not chunk.last:
                return Batch(prefill=tuple(chunks), kv_copies=self._copies())
            # Its prompt completes now; it leaves `chunked`, so _reserved_tokens no longer
            # counts its output: keep it promised (its first token's slot is allocated).
            promised += min(chunk.req.remaining_new_tokens, cfg.clip_max_new_tokens) - 1
        num_active = len(self.running) + len(chunks)
        if budget > 0 and self.waiting and num_active < cfg.max_running_requests:
            chunks.extend(self._admit(budget, num_active, promised))
        if cfg.share_guard and self._admission_blocked and self.chunked is None:
            left = cfg.chunked_prefill_size - sum(c.num_tokens for c in chunks)
            clip = cfg.clip_max_new_tokens
            owed = sum(min(c.req.remaining_new_tokens, clip) - 1 for c in chunks if c.last)
            active = len(self.running) + len(chunks)
            chunks.extend(share_guard.admit_below_share(self, left, active, owed))
        if not chunks:
            return None
        self._in_batch = tuple(c.req for c in chunks)
        swap_in = 0
        if self._checkpointing:  # an RT admitted after a BE one may have overwritten its slots
            _, swap_in = restore_checkpointed(self, [], chunks, allocated=True)
        return Batch(prefill=tuple(chunks), swap_in_tokens=swap_in or 0, kv_copies=self._copies())

    def _admit(
        self,
        budget: int,
        num_active: int,
        promised: int,
        walk: Iterator[Request] | None = None,
    ) -> list[PrefillChunk]:
        """Pull requests from the policy's order while they fit (SGLang's PrefillAdder).

        Room is measured live: ``available_tokens()`` already reflects this step's
        allocations and the prefixes it locked (locking turns evictable tokens into
        locked ones), minus the reservation of running requests and what this step
        promised to the requests it admitted.
        """
        cfg = self.config
        clip = cfg.clip_max_new_tokens
        reserved_for: dict[frozenset, float] = {}  # by the classes a request may overwrite
        kv = self.kv
        chunks: list[PrefillChunk] = []
        if walk is None:
            walk = self.policy.order(tuple(self.waiting), self)
        try:
            for req in walk:
                if budget <= 0:
                    break
                if num_active >= cfg.max_running_requests:
                    self._admission_blocked = True
                    break
                tokens = req.all_ids()
                reserve = min(req.remaining_new_tokens, clip)
                cached = min(self.prefix_len(req), len(tokens) - 1)
                over = kv.overwrites(req)
                if over not in reserved_for:
                    reserved_for[over] = self._reserved_tokens(req)
                reserved = reserved_for[over]
                if len(tokens) - cached + reserve > kv.available_tokens(req) - reserved - promised:
                    self._admission_blocked = True
                    break  # SGLang stops at the first request that does not fit
                handle = kv.acquire_prefix(tokens, limit=len(tokens) - 1)
                extend = len(tokens) - handle.prefix_len
                n = min(extend, budget)
                last = n == extend
                alloc = n + 1 if last else n
                room = kv.available_tokens(req) - reserved - promised  # after the lock
                if extend + reserve > room or not kv.can_allocate(req, alloc):
                    kv.tree.unlock(handle.node)
                    self._admission_blocked = True
                    break
                kv.allocate(req, alloc)
                kv.pin(req)  # a later admission this step must not overwrite its prefill
                self._on_admit(req, handle, extend)
                chunks.append(PrefillChunk(req, handle.prefix_len, n, last))
                if last:  # a chunked request's rest is reserved via `self.chunked`
                    promised += extend + reserve - alloc
                budget -= n
                num_active += 1
                if not last:
                    self.chunked = req
                    break
        finally:
            if isinstance(walk, Generator):  # run its cleanup now
                walk.close()
        if chunks:
            self.waiting = without(self.waiting, [c.req for c in chunks])
            memo = self._match_memo
            for chunk in chunks:
                memo.pop(chunk.req, None)
        return chunks

    def _on_admit(self, req: Request, handle: PrefixHandle, extend: int) -> None:
        first = req.num_retractions == 0
        req.phase = Phase.RUNNING
        if req.queued_s is not None:
            req.queue_s += max(self._now - req.queued_s, 0.0)
            req.queued_s = None
        req.prefix_len = handle.prefix_len
        req.num_computed = handle.prefix_len
        self._handles[req] = handle
        if first:
            req.first_prefix_len = handle.prefix_len
            req.admit_s = self._now
            self.log.events.append(
                ServiceEvent(
                    self._now, req.client, req.rid, EventKind.PREFILL, req.input_len, extend
                )
            )
        self.policy.on_admitted(req, extend if first else 0)

    def _copies(self) -> tuple:
        """The KV copies this step's allocations and restores made (exact caches only)."""
        return tuple(self.kv.drain_copies())

    # ------------------------------------------------------------ memory pressure

    def _ensure_decode_memory(self) -> None:
        """Retract requests until every running one can grow (SGLang ``retract_decode``)."""
        if self.kv.available_tokens() >= len(self.running):
            return
        steps = self.config.retract_decode_steps
        while len(self.running) > 1 and (self.kv.available_tokens() < len(self.running) * steps):
            self._retract(self._victim())
        total_max_new = sum(r.max_new_tokens for r in self.running)
        decoded = sum(r.num_output for r in self.running)
        estimate = (decoded + steps * len(self.running)) / max(total_max_new, 1)
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, estimate))
        if not self._checkpointing and self.kv.available_tokens() < len(self.running):
            raise MemoryError("KV pool too small for a single running request")

    def _victim(self, pool: Sequence[Request] | None = None) -> Request:
        """Whom to retract from ``pool`` (default: the running requests): the policy's
        ``victim``, else — with the share guard — one of the largest holder's, else SGLang's."""
        pool = self.running if pool is None else pool
        victim_fn = self.policy_caps.victim
        if victim_fn is not None:
            return victim_fn(pool)
        if self.config.share_guard:
            return share_guard.decode_victim(self, pool)
        return self._default_victim(pool)

    def _default_victim(self, pool: Sequence[Request] | None = None) -> Request:
        # SGLang: fewest generated tokens first, then longest prompt (least work lost).
        pool = self.running if pool is None else pool
        return min(pool, key=lambda r: (r.num_output, -r.input_len, -r.seq))

    def _retract(self, req: Request) -> None:
        if req is self.chunked:  # only as a last resort (scheduler_liveness.unjam)
            self.chunked = None
        else:
            self.running.remove(req)
        self.kv.release(req, self._handles.pop(req))
        req.phase = Phase.WAITING
        req.num_computed = 0
        req.num_retractions += 1
        self.stats.num_retractions += 1
        req.queued_s = self._now
        self._enqueue(req)
        self._admission_blocked = False
        self.policy.on_retracted(req)

    # ------------------------------------------------------------ apply

    def apply(self, result: StepResult, now: float) -> None:
        """Account a finished step: new tokens, first-token times, finished requests."""
        self._now = now
        batch = result.batch
        self._in_batch = ()
        tokens = iter(result.next_token_ids)
        for chunk in batch.prefill:
            req = chunk.req
            req.num_computed += chunk.num_tokens
            if chunk.last:
                if not self.kv.keeps_private(req):  # else its KV enters the tree at the end
                    self._handles[req] = self.kv.commit(req, req.all_ids(), self._handles[req])
                self._emit_token(req, next(tokens))
                if not self._maybe_finish(req):
                    self.running.append(req)
        if batch.decode:
            cfg = self.config
            self.new_token_ratio = max(
                self.new_token_ratio - cfg.new_token_ratio_decay, cfg.min_new_token_ratio
            )
            finished = False
            for req in batch.decode:
                req.num_computed += 1  # the previous token's KV was computed by this step
                self._emit_token(req, next(tokens))
                finished |= req.done
            if finished:
                self.running = [r for r in self.running if not self._maybe_finish(r)]

    def _emit_token(self, req: Request, token_id: int) -> None:
        n = req.num_output
        req.output_ids.append(token_id)
        if req.first_token_s is None:
            req.first_token_s = self._now
        self.stats.num_decode_tokens += 1
        ev = ServiceEvent(self._now, req.client, req.rid, _DECODE, req.input_len, 0, n, n + 1)
        self.log.events.append(ev)
        self.policy.on_tokens(req, 1)

    def _maybe_finish(self, req: Request) -> bool:
        if not req.done:
            return False
        tokens = req.all_ids()  # exact: only computed KV (the last token's never is)
        tokens = tokens[: req.num_computed] if self.kv.exact else tokens
        handle = self.kv.commit(req, tokens, self._handles.pop(req))
        self.kv.release(req, handle)
        self.kv.forget(req)
        req.phase = Phase.FINISHED
        req.finish_s = self._now
        self._admission_blocked = False
        self.log.done.append(req)
        self.policy.on_finished(req)
        return True

    # ------------------------------------------------------------ introspection

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        in_flight = set(map(id, self.running)) | set(map(id, self._in_batch))
        if self.chunked is not None:
            in_flight.add(id(self.chunked))
        assert in_flight == set(map(id, self._handles)), "handles do not match running requests"
        assert not in_flight & set(map(id, self.waiting)), "a request is both waiting and running"
        assert all(r.phase is Phase.WAITING for r in self.waiting)
        assert all(r.phase is Phase.RUNNING for r in self.running)
        assert len(self.running) <= self.config.max_running_requests
        for r in self.running:
            # A running request holds KV for every token but the one it will feed next.
            assert r.num_computed == r.seq_len - 1, f"{r}: computed {r.num_computed}"
