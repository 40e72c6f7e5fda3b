"""What the scheduler answers its policy (``sgl_fair.policies.base.SchedulerView``): the
clock, cached prefix lengths, KV need and room per request (and the room retracting a running
request would add), the chunk a step continues first,
checkpointed and device slots, and the KV usage FairServe's OIT probes.

A mixin of ``Scheduler`` (``worker/scheduler.py``), kept apart so that module stays about
scheduling; it reads the scheduler's own state (``kv``, ``config``, ``chunked``, memo and
prefix handles, through their public names) and holds none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_fair.request import Request

if TYPE_CHECKING:
    from sgl_fair.radix import MatchMemo
    from sgl_fair.worker.admission import Admission
    from sgl_fair.worker.kv.prefix_cache import PrefixHandle, PrefixKVCache
    from sgl_fair.worker.scheduler_state import SchedulerConfig


class SchedulerViewMixin:
    kv: PrefixKVCache
    config: SchedulerConfig
    chunked: Request | None
    now: float  # the clock of the last call (``SchedulerView.now``)
    match_memo: dict[Request, MatchMemo]
    handles: dict[Request, PrefixHandle]
    new_token_ratio: float
    admission: Admission  # ``reserved_tokens(req)``: the running requests' reserved KV

    def kv_usage(self) -> float:
        """Share of the KV pool that is neither free nor evictable, in [0, 1]."""
        capacity = self.kv.capacity_tokens
        return 1.0 - self.kv.available_tokens() / capacity if capacity else 0.0

    def prefix_len(self, req: Request) -> int:
        memo = self.match_memo.get(req)
        fresh = self.kv.memo_match(req.all_ids(), memo)
        if fresh is not memo:
            self.match_memo[req] = fresh
        return fresh.length

    def kv_need(self, req: Request) -> int:
        """KV tokens admitting waiting ``req`` takes in the admission test: its uncached
        prompt plus its reserved output."""
        cached = min(self.prefix_len(req), req.seq_len - 1)
        return req.seq_len - cached + min(req.remaining_new_tokens, self.config.clip_max_new_tokens)

    def continued_chunk(self) -> tuple[int, int, bool] | None:
        """``(new tokens, context, last)`` of the prefill chunk this step runs before anything
        a policy picks: the rest of a prompt chunked over steps (one at a time, as SGLang).
        Unless it is the ``last``, the step admits no waiting request."""
        req = self.chunked
        if req is None:
            return None
        done, left = req.num_computed, req.seq_len - req.num_computed
        n = min(left, self.config.chunked_prefill_size)
        return n, done, n == left

    def kv_room(self, req: Request) -> float:
        """Room the admission test gives ``req`` now (for its class: an RT request may
        overwrite BE KV under bidirectional blocks), net of the running requests' reservation."""
        return self.kv.available_tokens(req) - self.admission.reserved_tokens(req)

    def kv_freed_by(self, victim: Request, req: Request) -> float:
        """Room ``req``'s admission test (``kv_room``) would gain if running ``victim`` were
        retracted: the KV only ``victim`` holds, plus its output reservation. Where ``req``
        may overwrite ``victim``'s class (bidirectional blocks, RT over BE) its room counts
        those slots already, and no reservation is held against it: only what host memory
        running short kept out of that room (SPEC §5's last resort, dropping BE)."""
        handle = self.handles.get(victim)
        if handle is None:
            return 0.0
        freed = self.kv.freed_by_release(victim, handle, req)
        if victim.service_class.value in self.kv.overwrites(req):
            return float(freed)
        clip = self.config.clip_max_new_tokens
        return freed + self.new_token_ratio * min(victim.remaining_new_tokens, clip)

    def kv_slots(self, req: Request) -> list[int]:
        """Flat device KV slots of ``req``'s positions, in order (exact caches only)."""
        return self.kv.kv_slots(req, self.handles[req])

    def checkpointed_slots(self, req: Request) -> int:
        """KV tokens of ``req`` checkpointed to host (0 unless the allocator checkpoints)."""
        return self.kv.checkpointed_slots(req)
