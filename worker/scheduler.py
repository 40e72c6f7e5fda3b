"""The worker's continuous-batching scheduler: pure, clock-agnostic, engine-agnostic.

``Scheduler`` holds the state (waiting, running, the chunked prompt, prefix handles, the
new-token ratio) and composes the parts that each do one job, through their public
surfaces and ``scheduler_state.SchedulerCore`` (none imports this module):

* ``admission.Admission`` — pulls waiting requests in while they fit (SGLang's PrefillAdder);
* ``retraction.Retraction`` — the victim chain (policy, share guard, SGLang) and preemption;
* ``decode_growth.DecodeGrowth`` — each decode's next KV slot, behind the cache's
  capabilities (restoring KV from host where the allocator moves it there);
* the step paths: ``step_paths.OrderStep`` (the policy's ``order`` walk, SGLang's
  ``get_next_batch_to_run``) or ``select_step.SelectStep`` (a ``BatchSelecting`` policy
  chooses the running set, seam #1b), priced by the iteration cost model ``cost``;
* ``scheduler_liveness`` — never idle with work; ``scheduler_view`` — what a policy may ask.

Admission is bounded by ``max_running_requests``, a per-step prefill token budget
(``chunked_prefill_size``; a prompt larger than what is left is chunked, one chunked request
at a time) and KV memory: cached prefixes are shared through the radix tree, and running
requests reserve room for their future output scaled by the *new-token ratio* (SGLang's
optimistic estimate, decayed each decode step and raised after a retraction). Allocation is
check-then-commit: tokens a step needs are allocated in ``step`` so ``apply`` never fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sgl_fair.policies.base import Policy, PolicyCaps, Rejection
from sgl_fair.radix import MatchMemo
from sgl_fair.records import EventKind, ServiceEvent
from sgl_fair.request import Phase, Request
from sgl_fair.worker.admission import Admission
from sgl_fair.worker.decode_growth import DecodeGrowth
from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.kv.prefix_cache import PrefixHandle, PrefixKVCache
from sgl_fair.worker.retraction import Retraction
from sgl_fair.worker.scheduler_liveness import unjam
from sgl_fair.worker.scheduler_state import (  # re-exported: their home for callers
    RunLog,
    SchedulerConfig,
    SchedulerStats,
    enqueue,
)
from sgl_fair.worker.scheduler_view import SchedulerViewMixin
from sgl_fair.worker.select_step import SelectStep
from sgl_fair.worker.step_paths import OrderStep

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
        self.config = config or SchedulerConfig()
        self.log = log if log is not None else RunLog()
        self.stats = SchedulerStats()
        self.waiting: list[Request] = []  # arrival order
        self.running: list[Request] = []  # prefilled, decoding
        self.chunked: Request | None = None  # admitted, prompt partly computed
        self.new_token_ratio = self.config.init_new_token_ratio
        self.handles: dict[Request, PrefixHandle] = {}  # each in-flight request's prefix
        self.now = 0.0
        # Waiting request -> memoized prefix match (valid until its tree path changes).
        self.match_memo: dict[Request, MatchMemo] = {}
        # SGLang's `batch_is_full`: the last walk stopped for lack of memory or running
        # slots, so skip walking (O(waiting)) until a request finishes, is retracted or
        # arrives. Decode steps run meanwhile, so this never idles the worker.
        self.admission_blocked = False
        self.blocked_decode_steps = 0
        # Requests whose prefill is in the batch between step() and apply().
        self.in_batch: tuple[Request, ...] = ()
        self.restored_tokens = 0  # KV a continued chunk got back from host, this step
        # The parts, each with one job (module docstring).
        self.admission = Admission(self)
        self.retraction = Retraction(self)
        self.growth = DecodeGrowth(self)
        select = caps.select_batch
        self.step_path = SelectStep(self, select) if select is not None else OrderStep(self)
        # Optional seam: a policy that throttles only under overload (FairServe's OIT) reads
        # the worker's KV usage through this probe.
        if caps.attach_load is not None:
            caps.attach_load(self.kv_usage)

    # ------------------------------------------------------------ arrivals

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_active(self) -> int:
        """Requests holding KV for computation: running, being prefilled, or chunked."""
        active = {id(r) for r in self.running}
        active.update(id(r) for r in self.in_batch)
        if self.chunked is not None:
            active.add(id(self.chunked))
        return len(active)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def add_request(self, req: Request, now: float) -> Rejection | None:
        """Queue a request, or reject it (returned and logged) if it can never run here."""
        self.now = now
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
        enqueue(self.waiting, req)
        self.admission_blocked = False
        return None

    def abort(self, req: Request, now: float, reason: str = "aborted") -> bool:
        """Cancel ``req`` wherever it is (waiting, running or mid-chunked-prefill).

        Must be called between steps (never between ``step`` and its ``apply``). Computed
        KV is kept in the prefix cache, as SGLang does for an aborted request; what the
        client was charged stays charged. Returns False if ``req`` is not here (finished
        already, or never added): aborting is idempotent.
        """
        if self.in_batch:
            raise RuntimeError("abort() between step() and apply()")
        self.now = now
        if req.phase is Phase.WAITING and req in self.waiting:
            self.waiting.remove(req)
            self.match_memo.pop(req, None)
            waiting = True
        elif req.phase is Phase.RUNNING and (req is self.chunked or req in self.running):
            if req is self.chunked:
                self.chunked = None
            else:
                self.running.remove(req)
            handle = self.handles.pop(req)
            computed = req.all_ids()[: req.num_computed]
            # Keep its KV in the cache, unless part of it is on the host (the allocator moved
            # it there): then it is dropped, host copy included.
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
        self.admission_blocked = False
        self.log.done.append(req)
        self.policy.on_aborted(req, waiting)
        return True

    # ------------------------------------------------------------ step

    def step(self, now: float) -> Batch | None:
        """The next batch to run, or None when there is nothing to do (never while there is
        work: ``scheduler_liveness.unjam``)."""
        self.now = now
        batch = self._next_batch()
        if batch is None and self.has_work():
            batch = unjam(self, self._next_batch)
        if batch is not None and self.restored_tokens:
            batch = replace(batch, swap_in_tokens=batch.swap_in_tokens + self.restored_tokens)
            self.restored_tokens = 0
        return batch

    def _next_batch(self) -> Batch | None:
        self.kv.unpin_all()  # what the last step prefilled may be overwritten again
        return self.step_path.step()

    def copies(self) -> tuple:
        """The KV copies this step's allocations and restores made (exact caches only)."""
        return tuple(self.kv.drain_copies())

    # ------------------------------------------------------------ apply

    def apply(self, result: StepResult, now: float) -> None:
        """Account a finished step: new tokens, first-token times, finished requests."""
        self.now = now
        batch = result.batch
        self.in_batch = ()
        tokens = iter(result.next_token_ids)
        for chunk in batch.prefill:
            req = chunk.req
            req.num_computed += chunk.num_tokens
            if chunk.last:
                if not self.kv.keeps_private(req):  # else its KV enters the tree at the end
                    self.handles[req] = self.kv.commit(req, req.all_ids(), self.handles[req])
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
            req.first_token_s = self.now
        self.stats.num_decode_tokens += 1
        ev = ServiceEvent(self.now, req.client, req.rid, _DECODE, req.input_len, 0, n, n + 1)
        self.log.events.append(ev)
        self.policy.on_tokens(req, 1)

    def _maybe_finish(self, req: Request) -> bool:
        if not req.done:
            return False
        tokens = req.all_ids()  # exact: only computed KV (the last token's never is)
        tokens = tokens[: req.num_computed] if self.kv.exact else tokens
        handle = self.kv.commit(req, tokens, self.handles.pop(req))
        self.kv.release(req, handle)
        self.kv.forget(req)
        req.phase = Phase.FINISHED
        req.finish_s = self.now
        self.admission_blocked = False
        self.log.done.append(req)
        self.policy.on_finished(req)
        return True

    # ------------------------------------------------------------ introspection

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        in_flight = set(map(id, self.running)) | set(map(id, self.in_batch))
        if self.chunked is not None:
            in_flight.add(id(self.chunked))
        assert in_flight == set(map(id, self.handles)), "handles do not match running requests"
        assert not in_flight & set(map(id, self.waiting)), "a request is both waiting and running"
        assert all(r.phase is Phase.WAITING for r in self.waiting)
        assert all(r.phase is Phase.RUNNING for r in self.running)
        assert len(self.running) <= self.config.max_running_requests
        for r in self.running:
            # A running request holds KV for every token but the one it will feed next.
            assert r.num_computed == r.seq_len - 1, f"{r}: computed {r.num_computed}"
