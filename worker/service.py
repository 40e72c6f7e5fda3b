"""One worker behind the router protocol: messages in, messages out, no clock, no sockets.

The cluster simulator (virtual time, in-process delivery) and the live worker process (wall
clock, zmq) drive the same object, so they cannot disagree about what a worker reports::

    core.add(req, now) / core.abort(rid, now, why) / core.flush()     router -> worker
    result = core.step(now)            # None when idle; else run for result.duration_s
    core.complete(result, now)         # the step's results are in
    out = core.drain(now)              # Tokens, Finished, Evicted/KV changes, Load, in order

``Finished`` carries every way a request leaves (finished, rejected at arrival, aborted);
log-probabilities are attached when the request asked for them. An abort that arrives while a
step runs takes effect when it completes (a running batch cannot lose a member).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl_fair.messages import Evicted, Finished, FinishReason, Load, Tokens
from sgl_fair.request import Phase, Request
from sgl_fair.worker.engine import StepResult
from sgl_fair.worker.scheduler import Scheduler


@dataclass
class Drained:
    """What a worker has to report, in the order it must be sent."""

    messages: list[Any] = field(default_factory=list)  # Tokens, Finished, Evicted, Load
    # Prefix-cache changes ("stored" | "removed" | "cleared", path, start), oldest first, for
    # a KV-event publisher (live workers); empty unless ``kv_changes=True``.
    kv_changes: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)


class WorkerCore:
    def __init__(
        self,
        wid: int,
        scheduler: Scheduler,
        engine: Any,
        *,
        load_interval_s: float = 0.1,
        report_evictions: bool = True,
        kv_changes: bool = False,
        keep_log: bool = True,
    ) -> None:
        """``keep_log=False`` (a live worker): the scheduler's log of finished requests and
        service events is emptied at every ``drain`` once reported, so a worker that serves
        for days holds only what is in flight. The simulators keep it for their metrics."""
        if load_interval_s <= 0:
            raise ValueError(f"load_interval_s must be > 0 (got {load_interval_s})")
        self.wid = wid
        self.boot = 0  # its process's boot id, in every Load (a live worker's; 0: not said)
        self.draining = False  # stopping after what it holds: said in every Load
        self.scheduler = scheduler
        self.engine = engine
        self.load_interval_s = load_interval_s
        self.report_evictions = report_evictions
        self.kv_changes = kv_changes
        self.keep_log = keep_log
        if report_evictions:
            scheduler.kv.record_evictions()
        if kv_changes:
            scheduler.kv.record_kv_events()
        self.requests: dict[str, Request] = {}  # rid -> request, while here
        self.busy_s = 0.0
        self.num_added = 0
        self._in_step = False
        self._pending_aborts: list[tuple[str, str]] = []
        self._tokens: list[tuple[str, tuple[int, ...]]] = []
        self._tokens_t = 0.0
        self._reported = 0  # entries of scheduler.log.done already reported
        self._last_load_s = float("-inf")

    # ---- router -> worker -------------------------------------------------------------------

    def add(self, req: Request, now: float) -> bool:
        """Queue ``req``; False if it was rejected (its Finished goes out with the next drain)."""
        if req.rid in self.requests:
            raise ValueError(f"request {req.rid!r} is already on worker {self.wid}")
        self.num_added += 1
        rejected = self.scheduler.add_request(req, now) is not None
        if not rejected:
            self.requests[req.rid] = req
        return not rejected

    def abort(self, rid: str, now: float, reason: str = "aborted") -> bool:
        """Cancel ``rid``; False if it is not here (finished already: aborts are idempotent)."""
        if rid not in self.requests:
            return False
        if self._in_step:
            self._pending_aborts.append((rid, reason))
            return True
        return self.scheduler.abort(self.requests[rid], now, reason)

    def flush(self) -> bool:
        """Drop the unlocked prefix cache; refused (False) while any request is here."""
        if self.requests or self._in_step:
            return False
        return self.scheduler.kv.flush()

    # ---- steps ------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._in_step and not self.scheduler.has_work()

    def step(self, now: float) -> StepResult | None:
        """Start the next step; None when there is nothing to run."""
        if self._in_step:
            raise RuntimeError("step() while a step is running")
        batch = self.scheduler.step(now)
        if batch is None:
            return None
        self._in_step = True
        result = self.engine.run(batch)
        self.busy_s += result.duration_s
        return result

    def complete(self, result: StepResult, now: float) -> None:
        """The step's tokens are in: account them, then apply aborts that waited for it."""
        self.scheduler.apply(result, now)
        self._in_step = False
        items = [(r.rid, (r.output_ids[-1],)) for r in result.batch.sampling_requests()]
        if items:
            self._tokens.extend(items)
            self._tokens_t = now
        pending, self._pending_aborts = self._pending_aborts, []
        for rid, reason in pending:
            req = self.requests.get(rid)
            if req is not None:
                self.scheduler.abort(req, now, reason)

    # ---- worker -> router -------------------------------------------------------------------

    def drain(self, now: float, *, force_load: bool = False) -> Drained:
        out = Drained()
        msgs = out.messages
        if self._tokens:
            msgs.append(Tokens(self.wid, self._tokens_t, tuple(self._tokens)))
            self._tokens = []
        done = self.scheduler.log.done
        for req in done[self._reported :]:
            msgs.append(self._finished(req, now))
            self.requests.pop(req.rid, None)
        if self.keep_log:
            self._reported = len(done)
        else:
            done.clear()
            self.scheduler.log.events.clear()
            self._reported = 0
        kv = self.scheduler.kv
        if self.report_evictions:
            blocks = kv.drain_evicted()
            if blocks:
                msgs.append(Evicted(self.wid, now, tuple(blocks)))
        if self.kv_changes:
            out.kv_changes = kv.drain_kv_events()
        if force_load or now - self._last_load_s >= self.load_interval_s:
            msgs.append(self.load(now))
        return out

    def load(self, now: float) -> Load:
        self._last_load_s = now
        sched = self.scheduler
        usage = sched.kv.usage()
        return Load(
            self.wid,
            now,
            len(sched.waiting),
            sched.num_active,
            usage.locked + usage.private,
            usage.cached,
            sched.kv.capacity_tokens,
            sched.stats.num_retractions,
            boot=self.boot,
            draining=self.draining,
        )

    def _finished(self, req: Request, now: float) -> Finished:
        error = None
        if req.phase is Phase.REJECTED:
            reason, error = FinishReason.REJECTED, req.reject_reason
        elif req.phase is Phase.ABORTED:
            reason, error = FinishReason.ABORTED, req.abort_reason
        elif req.output_ids and req.output_ids[-1] == getattr(self.engine, "eos_token_id", None):
            reason = FinishReason.STOP  # the (simulated) model ended on EOS
        else:
            reason = FinishReason.LENGTH
        lp = None
        if req.return_logprob and reason in (FinishReason.LENGTH, FinishReason.STOP):
            lp = self.engine.logprobs(req)
        return Finished(
            self.wid,
            req.finish_s if req.finish_s is not None else now,
            req.rid,
            req.client,
            reason,
            req.input_ids,
            tuple(req.output_ids),
            req.first_prefix_len or 0,
            error,
            lp.input if lp is not None else None,
            lp.output if lp is not None else None,
            lp.output_top if lp is not None else None,
            req.reject_retry_after_s,
            req.reject_limit,
            req.queue_s if req.admit_s is not None else None,
        )
