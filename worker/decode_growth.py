"""Decode growth: each decoding request's next KV slot, behind the KV cache's capabilities.

Token pools answer for a whole batch at once (``PrefixKVCache.allocate_each``). Where a token
count cannot say whether a request can grow (``kv.per_request_growth``: block allocators, or
KV that may be on the host), growth is tried request by request, and a request that cannot
grow sits the step out, keeping its KV. Where the allocator moves KV to host memory
(``kv.checkpoints``: bidirectional blocks, BROS), checkpointed KV is restored before its
request runs again — and one that this step's RT growth overwrote and that cannot come back
is retracted. Allocators that never move KV to host pay nothing for that.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgl_fair.request import Phase, Request
from sgl_fair.worker.engine import PrefillChunk
from sgl_fair.worker.kv.base import OutOfMemory
from sgl_fair.worker.scheduler_state import SchedulerCore


class DecodeGrowth:
    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    def decode_all(self) -> tuple[list[Request], int]:
        """The admission-walk path's decode step: every running request grows by one token.
        Returns the decoding requests and the tokens swapped in from host. Token pools: all
        of them (the caller made the memory). Otherwise one that cannot grow sits out; if
        none can, requests are retracted (the victim chain) until one can — none when even
        the last could not (it is retracted too: ``scheduler_liveness.unjam`` then frees the
        cache and admits afresh)."""
        core = self.core
        if not core.kv.per_request_growth:
            decode = core.running
            done = core.kv.allocate_each(decode)
            if done < len(decode):  # ensure_decode_memory left too little: a bug
                raise OutOfMemory(f"no KV for the next token of {decode[done]!r}")
            return decode, 0
        while True:
            decode, swap_in = self.grow_restored(list(core.running))
            if decode or not core.running:
                return decode, swap_in or 0
            core.retraction.retract(core.retraction.victim(core.running))

    def restore_admitted(self, chunks: Sequence[PrefillChunk]) -> int:
        """After a prefill step's allocations: restore what an RT admission overwrote of a BE
        prompt admitted before it; the tokens swapped in."""
        if not self.core.kv.checkpoints:
            return 0
        _, swap_in = self.restore([], chunks, allocated=True)
        return swap_in or 0

    def grow_restored(self, decode: list[Request]) -> tuple[list[Request], int | None]:
        """``grow``, then bring back what its own RT growth overwrote of BE requests grown
        before (one that cannot come back is retracted): every decode, when nothing follows in
        the step that could overwrite more."""
        decode, swap_in = self.grow(decode)
        if swap_in is None:
            return decode, None
        decode, more = self.restore(decode, allocated=True)
        return decode, swap_in + (more or 0)

    def grow(self, decode: list[Request]) -> tuple[list[Request], int | None]:
        """Restore and allocate each chosen decode's next slot; one that cannot sits out.
        ``None`` swapped in: the allocator never moves KV to host."""
        decode, swap_in = self.restore(decode)
        if swap_in is None:  # nothing is ever checkpointed: the whole batch's slots in one call
            return self._grow_resident(decode), None
        core = self.core
        ready: list[Request] = []
        for req in decode:  # one by one: an RT request's growth may checkpoint a later BE one
            if core.kv.checkpointed_slots(req) or req.phase is not Phase.RUNNING:
                continue
            while True:
                try:
                    core.kv.allocate(req, 1)  # checks before it changes anything
                except OutOfMemory:
                    if not self.retract_paused(decode, req):
                        break
                else:
                    ready.append(req)
                    break
        return ready, swap_in

    def _grow_resident(self, decode: list[Request]) -> list[Request]:
        """``grow`` where no KV is ever on the host: ``PrefixKVCache.allocate_each`` over the
        running decodes, resuming after the one that did not fit."""
        todo = [r for r in decode if r.phase is Phase.RUNNING]
        ready: list[Request] = []
        i = 0
        while i < len(todo):
            k = self.core.kv.allocate_each(todo[i:])
            ready.extend(todo[i : i + k])
            i += k
            if i < len(todo) and not self.retract_paused(decode, todo[i]):
                i += 1  # no room for it: it sits out (or was retracted itself)
        return ready

    def retract_paused(self, decode: list[Request], blocked: Request) -> bool:
        """Blocks, not tokens, may be short: retract one paused request (BE first) for room;
        False when every running request is a chosen decode. A policy that
        ``recomputes_blocked`` (vLLM's way; BROS's "No Bi-cache" baseline) retracts
        ``blocked`` itself instead: False."""
        core = self.core
        if core.policy_caps.recomputes_blocked:
            core.retraction.retract(blocked)
            return False
        paused = [r for r in core.running if r not in decode]
        if not paused:
            return False
        core.retraction.retract(core.retraction.victim(paused))
        return True

    def restore(
        self,
        decode: list[Request],
        chunks: Sequence[PrefillChunk] = (),
        *,
        allocated: bool = False,
    ) -> tuple[list[Request], int | None]:
        """Swap checkpointed KV back before a request runs again.

        Before allocation a decode whose restore does not fit sits this iteration out; after
        it (``allocated``) one that this step's RT growth overwrote and that cannot come
        back is retracted. ``None``: the allocator never moves KV to host."""
        core = self.core
        if not core.kv.checkpoints:
            return decode, None
        retraction = core.retraction
        ready, swap_in = [], 0
        for req in (*decode, *(c.req for c in chunks)):
            if core.kv.checkpointed_slots(req):
                ops = core.kv.restore(req)  # evicts cached prefixes for room
                while ops is None and allocated and req not in decode:
                    # Admitted this step and overwritten by a later admission: make room by
                    # retracting a running request (the victim chain).
                    pool = [r for r in core.running if r is not req and r not in decode]
                    if not pool:
                        raise MemoryError(f"KV pool too small to restore {req}")
                    retraction.retract(retraction.victim(pool))
                    ops = core.kv.restore(req)
                if ops is None:
                    if allocated and req in decode:
                        retraction.retract(req)
                    continue
                swap_in += sum(op.num_tokens for op in ops)
            if req in decode:
                ready.append(req)
        return ready, swap_in
