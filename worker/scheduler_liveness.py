"""The scheduler never idles with work (SPEC §0 (3), work-conserving; issue 31).

Two pieces, the scheduler's own code kept apart to keep ``scheduler.py`` small:

* :func:`continue_chunked` — the next chunk of a prompt prefilled over steps. On
  bidirectional blocks a BE prompt's pin lasts one step, so RT growth may checkpoint its slots
  to host between its chunks (lazy checkpointing, SPEC §5); they are copied back before the
  prompt continues, as for any BE request that runs again. Before, the rest was never
  continued (``can_allocate`` refuses a checkpointed BE request) while the pending prompt
  blocked every admission: the worker idled for good.
* :func:`unjam` — the last resort when a step finds nothing to run although requests wait,
  run or are mid-prefill. Token counts cannot say what block allocators (paged,
  bidirectional) can place: a cached prefix ending mid-block costs its request one more
  block than its tokens, and the admission walk locks that prefix, so evicting it cannot pay
  for it; fragmentation around cached prefixes hides room the counts do not see. Rather
  than make every room test block-exact (each admission check would walk the blocks, and
  every decision made while things run would move), the scheduler acts where a mismatch can
  hang it: it evicts every unlocked cached prefix and tries again; while that still runs
  nothing, it retracts what holds KV (the policy's victim first, a mid-prefill prompt last)
  and tries again. An empty pool of whole blocks holds any request ``add_request`` accepted
  (input + max_new_tokens <= capacity), so this ends with a batch — unless the policy itself
  admits nothing, which it may (then the step is idle, as the policy chose).
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_fair.worker.engine import Batch, PrefillChunk
from sgl_fair.worker.scheduler_state import SchedulerCore


def continue_chunked(sched: SchedulerCore, budget: int) -> PrefillChunk | None:
    """The next chunk of ``sched.chunked`` within ``budget``, allocated and pinned; None when
    it does not fit (it waits, holding its KV). KV checkpointed since its last chunk is
    restored first; the tokens copied are added to the step's ``swap_in_tokens``."""
    req = sched.chunked
    assert req is not None
    kv = sched.kv
    if sched.checkpointed_slots(req):
        ops = kv.restore(req)  # evicts cached prefixes for room
        if ops is None:
            return None
        sched.restored_tokens += sum(op.num_tokens for op in ops)
    remaining = req.seq_len - req.num_computed
    n = min(remaining, budget)
    last = n == remaining
    alloc = n + 1 if last else n
    if not kv.can_allocate(req, alloc):
        return None
    kv.allocate(req, alloc)
    kv.pin(req)
    if last:
        sched.chunked = None
    return PrefillChunk(req, req.num_computed, n, last)


def unjam(sched: SchedulerCore, next_batch: Callable[[], Batch | None]) -> Batch | None:
    """``next_batch`` found nothing to run while ``sched`` has work: evict the cache, then
    retract KV holders one by one, trying again after each (module docstring)."""
    kv = sched.kv
    sched.stats.num_unjams += 1
    kv.evict_all()
    while True:
        sched.admission_blocked = False
        batch = next_batch()
        if batch is not None or not sched.has_work():
            return batch
        retraction = sched.retraction
        if sched.running:
            retraction.retract(retraction.victim(sched.running))
        elif sched.chunked is not None:
            retraction.retract(sched.chunked)
        else:
            return None  # nothing holds KV: the policy admitted nothing
        kv.evict_all()
