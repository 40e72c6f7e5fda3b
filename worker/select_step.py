"""Batch selection (seam #1b): one scheduler iteration whose running set the policy chose.

``Scheduler.step`` calls :func:`step_selected` when its policy defines ``select_batch``
(see ``sgl_fair.policies.base``). It reuses the scheduler's own admission walk, retraction
and chunked-prefill continuation, so memory and budget rules are those of the default path:

1. ``chosen = policy.select_batch(waiting + running, scheduler, cost)``;
2. chosen running requests decode: checkpointed KV (bidirectional blocks) is restored first,
   memory is made by retracting *unchosen* (paused) requests first; one that still cannot
   grow sits the iteration out;
3. ``scheduler.chunked`` continues (``Scheduler.continued_chunk()`` tells the policy that
   chunk beforehand); chosen waiting requests are admitted in the chosen order (room for the
   first is made by retracting paused requests);
4. one mixed ``Batch`` (prefill chunks + decodes); unchosen running requests keep their KV.

Functions, not methods, to keep ``scheduler.py`` small; they are the scheduler's own code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.engine import Batch, PrefillChunk
from sgl_fair.worker.kv.base import OutOfMemory
from sgl_fair.worker.scheduler_liveness import continue_chunked

if TYPE_CHECKING:
    from sgl_fair.worker.scheduler import Scheduler


def step_selected(sched: Scheduler, select: Callable) -> Batch | None:
    """One iteration whose running set the policy chose (module docstring, seam #1b)."""
    candidates = (*sched.waiting, *sched.running)
    chosen = select(candidates, sched, sched.cost) if candidates else ()
    decode = [r for r in chosen if r.phase is Phase.RUNNING]
    admit = [r for r in chosen if r.phase is Phase.WAITING]
    if not decode and not admit and sched.chunked is None:
        decode = list(sched.running)  # the policy chose nothing runnable: keep decoding
    decode, swap_in = _grow(sched, _decode_memory(sched, decode))
    cfg = sched.config
    budget, chunks, promised = cfg.chunked_prefill_size, [], 0
    if sched.chunked is not None:
        chunk = continue_chunked(sched, budget)
        if chunk is not None:
            chunks.append(chunk)
            budget -= chunk.num_tokens
            if chunk.last:
                promised += min(chunk.req.remaining_new_tokens, cfg.clip_max_new_tokens) - 1
    if admit and sched.chunked is None and budget > 0:
        _make_room(sched, admit, decode, promised, budget)
        num_active = len(sched.running) + len(chunks)
        chunks.extend(sched._admit(budget, num_active, promised, iter(admit)))
    sched._admission_blocked = False
    if swap_in is not None:  # this step's RT growth may have overwritten chosen BE slots
        decode, more = restore_checkpointed(sched, decode, chunks, allocated=True)
        swap_in += more
    while not chunks and not decode and sched.running:  # no progress: retract until some
        decode, more = _grow_restored(sched, _decode_memory(sched, list(sched.running)))
        swap_in = None if swap_in is None else swap_in + (more or 0)
        if decode or len(sched.running) <= 1:
            break
        pool = sched.running
        sched._retract(sched._victim(pool))
    if not chunks and not decode:
        return None
    sched._in_batch = tuple(c.req for c in chunks)
    if chunks:
        sched.stats.num_prefill_steps += 1
        sched.stats.num_prefill_tokens += sum(c.num_tokens for c in chunks)
    if decode:
        sched.stats.num_decode_steps += 1
    return Batch(
        prefill=tuple(chunks),
        decode=tuple(decode),
        swap_in_tokens=swap_in or 0,
        kv_copies=sched._copies(),
    )


def decode_restoring(sched: Scheduler) -> tuple[list[Request], int]:
    """The default path's decode step under an allocator that checkpoints (bidirectional
    blocks) — ``Scheduler.step`` calls it for policies without ``select_batch``.

    Every running request decodes, its checkpointed KV restored first; one whose restore or
    next slot does not fit sits the step out (keeping its KV); one this step's RT growth
    overwrote and that cannot come back is retracted. If no request can run, requests are
    retracted (``Scheduler._victim``) until one can. Returns the decoding
    requests and the tokens swapped in; none when even the last could not (it is retracted
    too: ``scheduler_liveness.unjam`` then frees the cache and admits afresh)."""
    while True:
        decode, swap_in = _grow_restored(sched, list(sched.running))
        if decode or not sched.running:
            return decode, swap_in or 0
        sched._retract(sched._victim(sched.running))


def _grow_restored(sched: Scheduler, decode: list[Request]) -> tuple[list[Request], int | None]:
    """``_grow``, then bring back what its own RT growth overwrote of BE requests grown
    before (one that cannot come back is retracted): every decode, when nothing follows in
    the step that could overwrite more."""
    decode, swap_in = _grow(sched, decode)
    if swap_in is None:
        return decode, None
    decode, more = restore_checkpointed(sched, decode, allocated=True)
    return decode, swap_in + more


def _grow(sched: Scheduler, decode: list[Request]) -> tuple[list[Request], int | None]:
    """Restore and allocate each chosen decode's next slot; one that cannot sits out."""
    decode, swap_in = restore_checkpointed(sched, decode)
    if swap_in is None:  # nothing is ever checkpointed: the whole batch's slots in one call
        return _grow_resident(sched, decode), None
    ready: list[Request] = []
    for req in decode:  # one by one: an RT request's growth may checkpoint a later BE one
        if sched.checkpointed_slots(req) or req.phase is not Phase.RUNNING:
            continue
        while True:
            try:
                sched.kv.allocate(req, 1)  # checks before it changes anything
            except OutOfMemory:
                if not _retract_paused(sched, decode, req):
                    break
            else:
                ready.append(req)
                break
    return ready, swap_in


def _grow_resident(sched: Scheduler, decode: list[Request]) -> list[Request]:
    """``_grow`` where no KV is ever on the host: ``PrefixKVCache.allocate_each`` over the
    running decodes, resuming after the one that did not fit."""
    todo = [r for r in decode if r.phase is Phase.RUNNING]
    ready: list[Request] = []
    i = 0
    while i < len(todo):
        k = sched.kv.allocate_each(todo[i:])
        ready.extend(todo[i : i + k])
        i += k
        if i < len(todo) and not _retract_paused(sched, decode, todo[i]):
            i += 1  # no room for it: it sits out (or was retracted itself)
    return ready


def _retract_paused(sched: Scheduler, decode: list[Request], blocked: Request) -> bool:
    """Blocks, not tokens, may be short: retract one paused request (BE first) for room;
    False when every running request is a chosen decode. A policy that ``recomputes_blocked``
    (vLLM's way; BROS's "No Bi-cache" baseline) retracts ``blocked`` itself instead: False."""
    if sched.policy_caps.recomputes_blocked:
        sched._retract(blocked)
        return False
    paused = [r for r in sched.running if r not in decode]
    if not paused:
        return False
    sched._retract(sched._victim(paused))
    return True


def restore_checkpointed(
    sched: Scheduler,
    decode: list[Request],
    chunks: Sequence[PrefillChunk] = (),
    *,
    allocated: bool = False,
) -> tuple[list[Request], int | None]:
    """Swap checkpointed KV back (bidirectional blocks) before a request runs again.

    Before allocation a decode whose restore does not fit sits this iteration out; after
    it (``allocated``) one that this step's RT growth overwrote and that cannot come
    back is retracted. ``None``: the allocator never checkpoints."""
    if not sched.kv.checkpoints:
        return decode, None
    ready, swap_in = [], 0
    for req in (*decode, *(c.req for c in chunks)):
        if sched.checkpointed_slots(req):
            ops = sched.kv.restore(req)  # evicts cached prefixes for room
            while ops is None and allocated and req not in decode:
                # Admitted this step and overwritten by a later admission: make room by
                # retracting a running request (``Scheduler._victim``).
                pool = [r for r in sched.running if r is not req and r not in decode]
                if not pool:
                    raise MemoryError(f"KV pool too small to restore {req}")
                sched._retract(sched._victim(pool))
                ops = sched.kv.restore(req)
            if ops is None:
                if allocated and req in decode:
                    sched._retract(req)
                continue
            swap_in += sum(op.num_tokens for op in ops)
        if req in decode:
            ready.append(req)
    return ready, swap_in


def _short(sched: Scheduler, decode: list[Request]) -> bool:
    """Whether the chosen decodes' next tokens may not fit: per class where the allocator
    places by class (an RT request cannot grow into another RT request's block)."""
    kv = sched.kv
    if len(decode) > kv.available_tokens():
        return True
    if not kv.classed:
        return False  # one room for every class: the test above was it
    by_class: dict[object, list[Request]] = {}
    for r in decode:
        by_class.setdefault(r.service_class, []).append(r)
    return any(len(reqs) > kv.available_tokens(reqs[0]) for reqs in by_class.values())


def _decode_memory(sched: Scheduler, decode: list[Request]) -> list[Request]:
    """Retract (paused requests first) until every chosen decode can grow by one token
    (none under a policy that ``recomputes_blocked``: ``_grow`` retracts those that cannot)."""
    if sched.policy_caps.recomputes_blocked:
        return decode
    while decode and _short(sched, decode) and len(sched.running) > 1:
        paused = [r for r in sched.running if r not in decode]
        pool = paused or sched.running
        victim = sched._victim(pool)
        sched._retract(victim)
        if victim in decode:
            decode.remove(victim)
    if not sched._checkpointing and sched.kv.available_tokens() < len(decode):
        raise MemoryError("KV pool too small for a single running request")
    return decode  # blocks: one may grow in its own block (``_grow`` asks each)


def _make_room(
    sched: Scheduler, admit: list[Request], decode: list[Request], promised: int, budget: int
) -> None:
    """Retract paused (unchosen) running requests until the policy's picks fit, in pick order
    and as far as the step's prefill budget reaches (``Scheduler._victim`` chooses whom). An
    RT pick retracts only BE requests (BROS counts their KV as its room, SPEC §5 l.5; an RT
    request never loses its KV to another); a BE pick, the first only, any paused request.
    Stops at the first pick that cannot be made to fit, and at a BE pick after the first
    (policies list their RT picks first; the rest are admitted as they fit).

    Only requests whose retraction adds room (``kv_freed_by``): on bidirectional blocks an RT
    request's room already counts the BE slots it may overwrite, so a BE request is dropped
    for it only where host memory ran short (SPEC §5's last resort); a BE pick there retracts
    nothing (it must not cost other requests their progress)."""
    need, chosen = 0, set(map(id, decode))
    for i, req in enumerate(admit):
        rt = req.service_class is ServiceClass.RT
        if budget <= 0 or sched.kv.keeps_private(req) or (i and not rt):
            return
        need += sched.kv_need(req)
        budget -= req.seq_len - min(sched.prefix_len(req), req.seq_len - 1)
        while need > sched.kv_room(req) - promised:
            paused = [r for r in sched.running if id(r) not in chosen]
            if rt:  # BE requests only, and only those whose retraction adds room
                be = ServiceClass.BE
                paused = [r for r in paused if r.service_class is be and sched.kv_freed_by(r, req)]
            if not paused:
                return
            sched._retract(sched._victim(paused))
