"""Batch selection (seam #1b): one scheduler iteration whose running set the policy chose.

``Scheduler.step`` runs :class:`SelectStep` when its policy is ``BatchSelecting``
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

Its decode growth and restores are ``decode_growth.DecodeGrowth``'s; retraction goes through
``retraction.Retraction`` (the victim chain) and admission through ``admission.Admission``.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_fair.request import Phase, Request, ServiceClass
from sgl_fair.worker.engine import Batch
from sgl_fair.worker.scheduler_liveness import continue_chunked
from sgl_fair.worker.scheduler_state import SchedulerCore


class SelectStep:
    """One iteration whose running set the policy chose (module docstring, seam #1b)."""

    def __init__(self, core: SchedulerCore, select: Callable) -> None:
        self.core = core
        self.select = select

    def step(self) -> Batch | None:
        sched = self.core
        growth, retraction = sched.growth, sched.retraction
        candidates = (*sched.waiting, *sched.running)
        chosen = self.select(candidates, sched, sched.cost) if candidates else ()
        decode = [r for r in chosen if r.phase is Phase.RUNNING]
        admit = [r for r in chosen if r.phase is Phase.WAITING]
        if not decode and not admit and sched.chunked is None:
            decode = list(sched.running)  # the policy chose nothing runnable: keep decoding
        retractions = sched.stats.num_retractions
        decode, swap_in = growth.grow(self._decode_memory(decode))
        cfg = sched.config
        if not cfg.prefill_after_retract and sched.stats.num_retractions > retractions:
            admit = []  # vLLM's rule (SchedulerConfig): no admission in a step that preempted
        budget, chunks, promised = cfg.chunked_prefill_size, [], 0
        if sched.chunked is not None:
            chunk = continue_chunked(sched, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
                if chunk.last:
                    promised += min(chunk.req.remaining_new_tokens, cfg.clip_max_new_tokens) - 1
        if admit and sched.chunked is None and budget > 0:
            self._make_room(admit, decode, promised, budget)
            num_active = len(sched.running) + len(chunks)
            chunks.extend(sched.admission.admit(budget, num_active, promised, iter(admit)))
        sched.admission_blocked = False
        if swap_in is not None:  # this step's RT growth may have overwritten chosen BE slots
            decode, more = growth.restore(decode, chunks, allocated=True)
            swap_in += more
        while not chunks and not decode and sched.running:  # no progress: retract until some
            decode, more = growth.grow_restored(self._decode_memory(list(sched.running)))
            swap_in = None if swap_in is None else swap_in + (more or 0)
            if decode or len(sched.running) <= 1:
                break
            pool = sched.running
            retraction.retract(retraction.victim(pool))
        if not chunks and not decode:
            return None
        sched.in_batch = tuple(c.req for c in chunks)
        if chunks:
            sched.stats.num_prefill_steps += 1
            sched.stats.num_prefill_tokens += sum(c.num_tokens for c in chunks)
        if decode:
            sched.stats.num_decode_steps += 1
        return Batch(
            prefill=tuple(chunks),
            decode=tuple(decode),
            swap_in_tokens=swap_in or 0,
            kv_copies=sched.copies(),
        )

    def _short(self, decode: list[Request]) -> bool:
        """Whether the chosen decodes' next tokens may not fit: per class where the allocator
        places by class (an RT request cannot grow into another RT request's block)."""
        sched = self.core
        kv = sched.kv
        if len(decode) > kv.available_tokens():
            return True
        if not kv.classed:
            return False  # one room for every class: the test above was it
        by_class: dict[object, list[Request]] = {}
        for r in decode:
            by_class.setdefault(r.service_class, []).append(r)
        return any(len(reqs) > kv.available_tokens(reqs[0]) for reqs in by_class.values())

    def _decode_memory(self, decode: list[Request]) -> list[Request]:
        """Retract (paused requests first) until every chosen decode can grow by one token
        (none under a policy that ``recomputes_blocked``: ``DecodeGrowth.grow`` retracts
        those that cannot)."""
        sched = self.core
        if sched.policy_caps.recomputes_blocked:
            return decode
        while decode and self._short(decode) and len(sched.running) > 1:
            paused = [r for r in sched.running if r not in decode]
            pool = paused or sched.running
            victim = sched.retraction.victim(pool)
            sched.retraction.retract(victim)
            if victim in decode:
                decode.remove(victim)
        if not sched.kv.per_request_growth and sched.kv.available_tokens() < len(decode):
            raise MemoryError("KV pool too small for a single running request")
        return decode  # blocks: one may grow in its own block (``DecodeGrowth.grow`` asks each)

    def _make_room(
        self, admit: list[Request], decode: list[Request], promised: int, budget: int
    ) -> None:
        """Retract paused (unchosen) running requests until the policy's picks fit, in pick order
        and as far as the step's prefill budget reaches (the victim chain chooses whom). An
        RT pick retracts only BE requests (BROS counts their KV as its room, SPEC §5 l.5; an RT
        request never loses its KV to another); a BE pick, the first only, any paused request.
        Stops at the first pick that cannot be made to fit, and at a BE pick after the first
        (policies list their RT picks first; the rest are admitted as they fit).

        Only requests whose retraction adds room (``kv_freed_by``): on bidirectional blocks an RT
        request's room already counts the BE slots it may overwrite, so a BE request is dropped
        for it only where host memory ran short (SPEC §5's last resort); a BE pick there retracts
        nothing (it must not cost other requests their progress)."""
        sched = self.core
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
                    paused = [
                        r for r in paused if r.service_class is be and sched.kv_freed_by(r, req)
                    ]
                if not paused:
                    return
                sched.retraction.retract(sched.retraction.victim(paused))
