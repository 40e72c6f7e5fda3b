"""Retraction: whom to preempt when KV runs out, and how (SGLang's ``retract_decode``).

The victim chain: the policy's own ``victim`` (``Retracting``: BROS retracts BE first), else,
with the share guard, one of the largest holder's requests (``share_guard.decode_victim``),
else SGLang's rule (fewest generated tokens, then longest prompt: least work lost). A
retracted request frees its private KV (its prompt's prefix stays cached), goes back to the
waiting queue in arrival order and recomputes when admitted again.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgl_fair.request import Phase, Request
from sgl_fair.worker import share_guard
from sgl_fair.worker.scheduler_state import SchedulerCore, enqueue


class Retraction:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    def victim(self, pool: Sequence[Request] | None = None) -> Request:
        """Whom to retract from ``pool`` (default: the running requests): the policy's
        ``victim``, else — with the share guard — one of the largest holder's, else SGLang's."""
        core = self.core
        pool = core.running if pool is None else pool
        victim_fn = core.policy_caps.victim
        if victim_fn is not None:
            return victim_fn(pool)
        if core.config.share_guard:
            return share_guard.decode_victim(core, pool)
        return self.default_victim(pool)

    def default_victim(self, pool: Sequence[Request] | None = None) -> Request:
        """SGLang's rule: fewest generated tokens first, then longest prompt (least work
        lost), then the latest."""
        pool = self.core.running if pool is None else pool
        return min(pool, key=lambda r: (r.num_output, -r.input_len, -r.seq))

    def retract(self, req: Request) -> None:
        """Preempt running (or, as a last resort, mid-prefill) ``req``: free its KV and queue
        it again; the policy hears ``on_retracted``."""
        core = self.core
        if req is core.chunked:  # only as a last resort (scheduler_liveness.unjam)
            core.chunked = None
        else:
            core.running.remove(req)
        core.kv.release(req, core.handles.pop(req))
        req.phase = Phase.WAITING
        req.num_computed = 0
        req.num_retractions += 1
        core.stats.num_retractions += 1
        req.queued_s = core.now
        enqueue(core.waiting, req)
        core.admission_blocked = False
        core.policy.on_retracted(req)

    def retract_victim(self, pool: Sequence[Request] | None = None) -> Request:
        """Retract ``victim(pool)``; returns it."""
        victim = self.victim(pool)
        self.retract(victim)
        return victim

    def ensure_decode_memory(self) -> None:
        """Retract requests until every running one can grow (SGLang ``retract_decode``),
        and raise the new-token ratio as SGLang does after a retraction."""
        core = self.core
        kv = core.kv
        if kv.available_tokens() >= len(core.running):
            return
        steps = core.config.retract_decode_steps
        while len(core.running) > 1 and (kv.available_tokens() < len(core.running) * steps):
            self.retract(self.victim())
        total_max_new = sum(r.max_new_tokens for r in core.running)
        decoded = sum(r.num_output for r in core.running)
        estimate = (decoded + steps * len(core.running)) / max(total_max_new, 1)
        core.new_token_ratio = min(1.0, max(core.new_token_ratio, estimate))
        if not kv.per_request_growth and kv.available_tokens() < len(core.running):
            raise MemoryError("KV pool too small for a single running request")
