"""BROS's batch under construction (``sgl_fair/policies/bros.py``): its ``T_iter`` under the
iteration cost model, the KV it takes against the scheduler's room, and the BE work already
known to overrun the residual. Pure bookkeeping; the packing rules live in ``bros.py``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from sgl_fair.policies.base import SchedulerView
from sgl_fair.request import Phase, Request, ServiceClass


def _free_iteration(*, prefill_chunks=(), decode_context_lens=(), swap_in_tokens=0) -> float:
    return 0.0


def _takes_swap_in(cost: Callable[..., float]) -> bool:
    """Whether the cost callable prices overlapped swap-in (``swap_in_tokens=``)."""
    try:
        params = inspect.signature(cost).parameters
    except (TypeError, ValueError):
        return False
    return "swap_in_tokens" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


class _Memory:
    """KV the batch under construction takes, against the scheduler's admission room
    (SPEC §5 l.5: requests are added while blocks are available — free, or BE slots an RT may
    overwrite). A waiting request takes its admission need (``view.kv_need``), a running one
    the checkpointed slots it must swap back in; room is ``view.kv_room`` per class. A view
    without them (no memory model) never says no. Checking here keeps the scheduler from
    retracting running requests to make room for a pick that does not fit."""

    def __init__(
        self, view: SchedulerView, preemptible: Callable[[], Sequence[Request]] | None = None
    ) -> None:
        self._room_of = getattr(view, "kv_room", None)
        self._need_of = getattr(view, "kv_need", None)
        self._ckpt = getattr(view, "checkpointed_slots", None)
        self._room: dict[ServiceClass, float] = {}
        self._needs: dict[int, int] = {}
        self.taken = 0
        # Running BE requests an RT pick may retract for room (recompute), in the order the
        # scheduler retracts them (``BROS.victim``), and what each frees: listed when an RT
        # request first does not fit (``preemptible`` lists them; None: never).
        self._freed_by = getattr(view, "kv_freed_by", None)
        self._preemptible = preemptible if self._freed_by is not None else None
        self._pool: Sequence[Request] = ()
        self._pool_freed: list[float] | None = None
        self._pool_total = 0.0
        self.bonus = 0.0  # room the claimed victims free, for every class
        self.claimed: set[int] = set()  # id()s of the BE requests to retract this step

    def _need(self, req: Request) -> int:
        n = self._needs.get(id(req))
        if n is None:
            if req.phase is Phase.WAITING:
                n = self._need_of(req) if self._need_of is not None else 0
            else:
                n = self._ckpt(req) if self._ckpt is not None else 0
            self._needs[id(req)] = n
        return n

    def _room_for(self, req: Request) -> float:
        """The scheduler's room for ``req``'s class, asked once per selection."""
        room = self._room.get(req.service_class)
        if room is None:
            room = self._room[req.service_class] = self._room_of(req)
        return room

    def fits(self, req: Request, without: Request | None = None) -> bool:
        need = self._need(req)
        if not need or self._room_of is None:
            return True
        freed = 0 if without is None else self._need(without)
        return self.taken - freed + need <= self._room_for(req) + self.bonus

    def take_if_fits(self, req: Request) -> bool:
        """``take`` if ``fits``, in one call (the RT loop's common case)."""
        need = self._need(req)
        if not need:
            return True
        if not self.fits(req):
            return False
        self.taken += need
        return True

    def take_preempting(self, req: Request) -> bool:
        """``take`` an RT request that does not fit the room as it is but would once running
        BE requests are retracted (SPEC §5 l.5: BE blocks are preemptible; here by
        recompute). Which ones: ``settle`` decides, once the RT picks are final."""
        if (
            self._preemptible is None
            or self._room_of is None
            or req.service_class is not ServiceClass.RT
        ):
            return False
        if self._pool_freed is None:
            self._pool = self._preemptible()
            self._pool_freed = [self._freed_by(v, req) for v in self._pool]
            self._pool_total = sum(self._pool_freed)
        if not self._pool_total:  # nothing to gain (bidirectional blocks, host to spare)
            return False
        need = self._need(req)
        if self.taken + need > self._room_for(req) + self._pool_total:
            return False
        self.taken += need
        return True

    def settle(self) -> None:
        """Claim victims, in retraction order, until they free what the RT picks took beyond
        the room; the BE phase must not choose them, and their room counts for every pick."""
        room = self._room.get(ServiceClass.RT)
        if self._pool_freed is None or room is None:
            return
        for victim, freed in zip(self._pool, self._pool_freed, strict=True):
            if self.taken <= room + self.bonus:
                break
            if freed > 0:
                self.claimed.add(id(victim))
                self.bonus += freed

    def take(self, req: Request) -> None:
        self.taken += self._need(req)

    def give(self, req: Request) -> None:
        self.taken -= self._need(req)


class _Frontier:
    """Minimal work keys ``(kind, a, b, swap)`` (``_Batch.work_key``) seen to overrun."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: list[tuple[int, int, int, int]] = []

    def dominates(self, key: tuple[int, int, int, int]) -> bool:
        kind, a, b, swap = key
        for k, ka, kb, ks in self._keys:  # noqa: SIM110 (hot: a loop, not a generator per call)
            if k == kind and a >= ka and b >= kb and swap >= ks:
                return True
        return False

    def add(self, key: tuple[int, int, int, int]) -> None:
        if self.dominates(key):
            return
        kind, a, b, swap = key
        self._keys = [
            x for x in self._keys if not (x[0] == kind and x[1] >= a and x[2] >= b and x[3] >= swap)
        ]
        self._keys.append(key)


class _Batch:
    """The batch under construction and its ``T_iter`` (cost callable, re-evaluated on demand)."""

    def __init__(
        self,
        cost: Callable[..., float],
        view: SchedulerView,
        swap_ok: bool = False,
        fixed: tuple[int, int] | None = None,
    ) -> None:
        self.cost = cost
        self.view = view
        # Work the step runs whatever is picked (the scheduler's chunked-prefill continuation,
        # ``view.continued_chunk()``): priced in T_iter, never an item.
        self._fixed: list[tuple[int, int]] = [fixed] if fixed else []
        checkpointed = getattr(view, "checkpointed_slots", None) if swap_ok else None
        self._ckpt = checkpointed  # KV tokens a request has on the host (None: not counted)
        self._swap: dict[int, int] = {}  # id(req) -> tokens to swap in before it runs
        self.items: list[Request] = []
        self._chunks: dict[int, tuple[int, int]] = {}  # id(req) -> prefill chunk
        self._decodes: dict[int, int] = {}  # id(req) -> context length
        self._chunk_list: list[tuple[int, int]] = list(self._fixed)  # with those above
        self._decode_list: list[int] = []
        # id(req) -> its work: nothing the batch prices changes while it is built, and the BE
        # phase asks for one request's work up to three times (key, price, add).
        self._works: dict[int, tuple[tuple[int, int] | None, int | None]] = {}

    def __len__(self) -> int:
        return len(self.items)

    def _work(self, req: Request) -> tuple[tuple[int, int] | None, int | None]:
        work = self._works.get(id(req))
        if work is None:
            seq_len = req.seq_len
            if req.phase is Phase.RUNNING:
                work = None, seq_len
            else:
                cached = min(self.view.prefix_len(req), seq_len - 1)
                work = (seq_len - cached, cached), None
            self._works[id(req)] = work
        return work

    def work_key(self, req: Request) -> tuple[int, int, int, int]:
        """What ``req`` adds to ``T_iter``: (0, extend, cached, swap-in) for a prefill,
        (1, context, 0, swap-in) for a decode; the cost grows with each component."""
        chunk, ctx = self._work(req)
        swap = self._ckpt(req) if self._ckpt is not None else 0
        if chunk is not None:
            return 0, chunk[0], chunk[1], swap
        return 1, ctx, 0, swap

    def add(self, req: Request) -> None:
        chunk, ctx = self._work(req)
        self.items.append(req)
        if chunk is not None:
            self._chunks[id(req)] = chunk
            self._chunk_list.append(chunk)
        else:
            self._decodes[id(req)] = ctx
            self._decode_list.append(ctx)
        if self._ckpt is not None:
            n = self._ckpt(req)
            if n:
                self._swap[id(req)] = n

    def remove(self, req: Request) -> None:
        self.items.remove(req)
        self._chunks.pop(id(req), None)
        self._decodes.pop(id(req), None)
        self._chunk_list = self._fixed + list(self._chunks.values())  # rare (a swap): rebuild
        self._decode_list = list(self._decodes.values())
        self._swap.pop(id(req), None)

    def time(self, extra: Request | None = None, without: Request | None = None) -> float:
        if without is None:  # the common case: the batch's own lists, no copy
            chunks, decodes = self._chunk_list, self._decode_list
            swap = sum(self._swap.values()) if self._swap else 0
        else:
            gone = id(without)
            chunks = self._fixed + [v for k, v in self._chunks.items() if k != gone]
            decodes = [v for k, v in self._decodes.items() if k != gone]
            swap = sum(v for k, v in self._swap.items() if k != gone)
        return self._price(chunks, decodes, swap, extra)

    def _price(self, chunks: list, decodes: list, swap: int, extra: Request | None) -> float:
        """``cost`` of the lists with ``extra``'s work appended for the call and popped after
        (the lists may be the batch's own, kept in step with ``add`` and ``remove``)."""
        chunk = ctx = None
        if extra is not None:
            chunk, ctx = self._work(extra)
            if chunk is not None:
                chunks.append(chunk)
            else:
                decodes.append(ctx)
            if self._ckpt is not None:
                swap += self._ckpt(extra)
        try:
            return self._call(chunks, decodes, swap)
        finally:
            if chunk is not None:
                chunks.pop()
            elif ctx is not None:
                decodes.pop()

    def add_prefix(self, reqs: Sequence[Request], cap: float) -> int:
        """Add the longest prefix of ``reqs`` that keeps ``T_iter <= cap`` and return its
        length. ``T_iter`` never falls as requests join, so the prefix is found by binary
        search over prefix lengths: O(log n) prices instead of one per request."""
        chunks, decodes = list(self._chunk_list), list(self._decode_list)
        ends = [(len(chunks), len(decodes), sum(self._swap.values()))]
        works = []
        ckpt = self._ckpt
        for r in reqs:
            chunk, ctx = work = self._work(r)
            if chunk is not None:
                chunks.append(chunk)
            else:
                decodes.append(ctx)
            swap = ckpt(r) if ckpt is not None else 0
            works.append((work, swap))
            ends.append((len(chunks), len(decodes), ends[-1][2] + swap))

        def fits(m: int) -> bool:
            nc, nd, swap = ends[m]
            return self._call(chunks[:nc], decodes[:nd], swap) <= cap

        lo, hi = 0, len(reqs)  # the prefix of lo fits (or lo = 0), that of hi does not
        if fits(hi):
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        # Commit the prefix from the lists built above (what `add` would do, request by request).
        nc, nd, _ = ends[lo]
        del chunks[nc:], decodes[nd:]
        self._chunk_list, self._decode_list = chunks, decodes
        for r, ((chunk, ctx), swap) in zip(reqs[:lo], works, strict=False):
            self.items.append(r)
            if chunk is not None:
                self._chunks[id(r)] = chunk
            else:
                self._decodes[id(r)] = ctx
            if swap:
                self._swap[id(r)] = swap
        return lo

    def _call(self, chunks: list, decodes: list, swap: int) -> float:
        if swap:
            return self.cost(
                prefill_chunks=chunks, decode_context_lens=decodes, swap_in_tokens=swap
            )
        return self.cost(prefill_chunks=chunks, decode_context_lens=decodes)

    def time_with(self, req: Request, without: Request | None = None) -> float:
        return self.time(extra=req, without=without)

    def requests(self) -> list[Request]:
        return list(self.items)
