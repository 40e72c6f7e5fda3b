"""The admission-walk step (policies without ``select_batch``), SGLang's
``get_next_batch_to_run``::

    waiting ──policy.order──▶ admit while it fits ──▶ prefill batch   (priority)
                                  │ nothing admissible
                                  ▼
    running ─────────────────────────────────────▶ decode batch (+1 token each)
                                  │ out of KV memory
                                  ▼
                      retract requests back to waiting

The batch-selecting step is ``select_step.SelectStep``; ``Scheduler.step`` runs one of them.
"""

from __future__ import annotations

from sgl_fair.worker import share_guard
from sgl_fair.worker.engine import Batch, PrefillChunk
from sgl_fair.worker.scheduler_liveness import continue_chunked
from sgl_fair.worker.scheduler_state import SchedulerCore


class OrderStep:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    def step(self) -> Batch | None:
        """A prefill batch if anything can be admitted (or a chunk continues), else a decode
        batch, else None."""
        core = self.core
        every = core.config.recheck_blocked_every
        if core.admission_blocked and every and core.blocked_decode_steps >= every:
            core.admission_blocked = False
        if core.chunked is not None or (core.waiting and not core.admission_blocked):
            batch = self._prefill()
            if batch is not None:
                core.stats.num_prefill_steps += 1
                core.stats.num_prefill_tokens += batch.num_prefill_tokens
                return batch
        if core.running:
            core.retraction.ensure_decode_memory()
            decode, swap_in = core.growth.decode_all()
            if not decode:  # nothing could grow, all retracted: try admitting
                return None
            core.blocked_decode_steps = (
                core.blocked_decode_steps + 1 if core.admission_blocked else 0
            )
            core.stats.num_decode_steps += 1
            return Batch(decode=tuple(decode), swap_in_tokens=swap_in, kv_copies=core.copies())
        core.new_token_ratio = core.config.init_new_token_ratio
        return None

    def _prefill(self) -> Batch | None:
        core = self.core
        cfg = core.config
        budget = cfg.chunked_prefill_size
        chunks: list[PrefillChunk] = []
        # KV promised to requests of this batch but not allocated yet (their future output).
        promised = 0
        if core.chunked is not None:
            chunk = continue_chunked(core, budget)
            if chunk is None:
                return None
            chunks.append(chunk)
            budget -= chunk.num_tokens
            if not chunk.last:
                return Batch(prefill=tuple(chunks), kv_copies=core.copies())
            # Its prompt completes now; it leaves `chunked`, so reserved_tokens no longer
            # counts its output: keep it promised (its first token's slot is allocated).
            promised += min(chunk.req.remaining_new_tokens, cfg.clip_max_new_tokens) - 1
        num_active = len(core.running) + len(chunks)
        if budget > 0 and core.waiting and num_active < cfg.max_running_requests:
            chunks.extend(core.admission.admit(budget, num_active, promised))
        if cfg.share_guard and core.admission_blocked and core.chunked is None:
            left = cfg.chunked_prefill_size - sum(c.num_tokens for c in chunks)
            clip = cfg.clip_max_new_tokens
            owed = sum(min(c.req.remaining_new_tokens, clip) - 1 for c in chunks if c.last)
            active = len(core.running) + len(chunks)
            chunks.extend(share_guard.admit_below_share(core, left, active, owed))
        if not chunks:
            return None
        core.in_batch = tuple(c.req for c in chunks)
        # An RT admitted after a BE one may have overwritten its slots: restore them.
        swap_in = core.growth.restore_admitted(chunks)
        return Batch(prefill=tuple(chunks), swap_in_tokens=swap_in, kv_copies=core.copies())
