"""BROS — real-time / best-effort co-serving (BROS paper Alg. 1; SPEC §5).

A batch-selecting policy (seam #1b, ``select_batch``): every iteration it picks the running
set from waiting + running requests, given the iteration cost model ``cost`` (the same
object the simulator charges, ``T_iter = cost(prefill_chunks=..., decode_context_lens=...)``).

* **RT packing** (l.3–15): RT requests (waiting and pending together) sorted by remaining
  time to their next token's deadline (Eq. 6, *our reading*)::

      remaining = SLO·n − (now − t_last) − (n − 1)·T̄      # SLO = TTFT for token 1, else TPOT

  ``residual`` = the smallest remaining time; RT requests are added in that order while the
  batch has fewer than ``B`` requests and ``T_iter(batch) <= residual``.
* **Early return** (l.11–12): when the next RT would make ``T_iter > residual`` the batch is
  returned as it is (no BE phase) and ``B = B0``. The most urgent RT request is always
  scheduled. *Our reading:* RT requests that cannot meet their deadline even alone
  (``remaining`` below one bare iteration) are scheduled first and do not set ``residual``
  — otherwise one late request would cap every later batch at one request.
* **BE phase** (l.17–33): BE requests sorted by checkpointed slots, fewest first (with an
  ``inner`` fairness policy, the least-served client first: VTC counter / DLPM deficit);
  each is added while the batch is not full, else it replaces the least-urgent scheduled RT
  that still has slack beyond the next iteration; always keeping ``T_iter <= residual``.
* **Adaptive B** (TCP-like): no early return → ``B += b_step`` up to the scheduler's
  ``max_running_requests``; early return → ``B = b0``. SPEC §5's ``B0 = 8`` is *our* choice
  (the paper's value was lost) and measured badly: with many RT decodes in flight, B = 8
  pauses all but 8 of them each iteration, the paused ones become the urgent ones, the next
  batch is cut early again, and B never climbs (``bros-hybrid``, Llama-3-70B TP 8, 15 RT
  req/s: TTFT attainment 0.10 vs FCFS's 0.50, BE throughput 16 % of FCFS's; with B out of
  the way 0.94 and 99 %). Decode iterations cost almost the same at 8 or 128 requests
  (memory-bound), so a small B buys no latency. The default ``b0=None`` starts and resets
  B at the scheduler's ``max_running_requests``; ``b0=8`` is the literal reading, kept as
  an option and as the experiment's ablation row.

Swap-in time of checkpointed blocks is in ``T_iter`` when the cost callable takes
``swap_in_tokens`` (the simulator's ``CostModel.step_time`` does: the copy overlaps the step,
``max``'ed, SPEC §5): each chosen request with KV on the host adds its checkpointed slots.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.policies.base import BasePolicy, Rejection, SchedulerView, make_policy, register
from sgl_fair.request import Phase, Request, ServiceClass

INNER_POLICIES = ("none", "vtc", "dlpm")


@register("bros")
class BROS(BasePolicy):
    @dataclass(frozen=True)
    class Config:
        # B0; None: the scheduler's max_running_requests (B never limits below it). See the
        # module docstring for why the default is not the SPEC's B0 = 8.
        b0: int | None = None
        b_step: int = 1
        group_size: int = 1  # Eq. 6's token group; 1 = per-token deadlines
        ema: float = 0.2  # weight of the newest iteration in T̄
        inner: str = "none"  # fairness among BE clients: none | vtc | dlpm
        inner_options: Mapping[str, Any] = field(default_factory=dict)

        def __post_init__(self) -> None:
            if (self.b0 is not None and self.b0 < 1) or self.b_step < 0 or self.group_size < 1:
                raise ValueError("bros: need b0 >= 1, b_step >= 0, group_size >= 1")
            if not 0 < self.ema <= 1:
                raise ValueError(f"bros: ema must be in (0, 1] (got {self.ema})")
            if self.inner not in INNER_POLICIES:
                raise ValueError(
                    f"bros: inner must be one of {', '.join(INNER_POLICIES)} (got {self.inner!r})"
                )

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.batch_limit = cfg.b0 or 1 << 30  # B (clipped to max_running_requests per step)
        self.num_early_returns = 0
        self.t_bar_s = 0.0  # moving-average iteration time T̄
        self.inner = None if cfg.inner == "none" else make_policy(cfg.inner, **cfg.inner_options)
        self._t_last: dict[int, float] = {}  # id(req) -> time of its last token
        self._fresh: list[Request] = []  # got tokens in the last step: t_last = next now
        self._cost: Callable[..., float] | None = None  # the last cost callable seen ...
        self._cost_swap = False  # ... and whether it prices swap-in

    # ---------------------------------------------------------------- events

    def _to_inner(self, req: Request) -> bool:
        return self.inner is not None and req.service_class is ServiceClass.BE

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        super().on_arrival(req, now)
        return self.inner.on_arrival(req, now) if self._to_inner(req) else None

    def on_admitted(self, req: Request, extend_len: int) -> None:
        super().on_admitted(req, extend_len)
        if self._to_inner(req):
            self.inner.on_admitted(req, extend_len)

    def on_tokens(self, req: Request, n: int) -> None:
        self._fresh.append(req)
        if self._to_inner(req):
            self.inner.on_tokens(req, n)

    def on_finished(self, req: Request) -> None:
        self._t_last.pop(id(req), None)
        if self._to_inner(req):
            self.inner.on_finished(req)

    def on_retracted(self, req: Request) -> None:
        super().on_retracted(req)
        if self._to_inner(req):
            self.inner.on_retracted(req)

    def on_aborted(self, req: Request, waiting: bool) -> None:
        if waiting:
            self.active.dequeue(req.client)
        self._t_last.pop(id(req), None)
        if self._to_inner(req):
            self.inner.on_aborted(req, waiting)

    # A host that cannot choose the running batch (SGLang's scheduler decodes every running
    # request) may still run BROS's admission order: `order` below (worker/sglang/settings.py).
    admission_order = True
    # It orders by RT/BE class: hosts carry each request's class to it (the SGLang plugin runs
    # SGLang's priority scheduling, and its bridges send the class as ``priority``).
    uses_service_classes = True

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        """BROS's admission order, for hosts without ``select_batch`` (our scheduler calls
        ``select_batch`` and never this): RT first, the most urgent first (Eq. 6's remaining
        time, as in l.3); then BE, the least-served client first under an ``inner`` policy
        (its own lazy order, charged by each admission), else in arrival order. What such a
        host lacks: pausing decodes, the residual cap on prefill and the adaptive B."""
        now = view.now
        self._stamp(now)
        rt = [r for r in waiting if r.service_class is ServiceClass.RT]
        be = [r for r in waiting if r.service_class is not ServiceClass.RT]
        rt.sort(key=lambda r: (self.remaining_s(r, now), r.seq))
        yield from rt
        if self.inner is not None:
            yield from self.inner.order(be, view)
        else:
            yield from be

    def victim(self, pool: Sequence[Request]) -> Request:
        """Retract BE first, then the RT with the most slack; fewest tokens lost within."""
        return max(pool, key=lambda r: (r.service_class is ServiceClass.BE, -r.num_output))

    # ---------------------------------------------------------------- deadlines

    def _stamp(self, now: float) -> None:
        """Requests that got tokens in the last step got them at ``now`` (``on_tokens`` runs
        before the clock is read)."""
        for req in self._fresh:
            self._t_last[id(req)] = now
        self._fresh.clear()

    def remaining_s(self, req: Request, now: float) -> float:
        """Eq. 6 (our reading): time left until ``req``'s next token-group deadline."""
        t_last = self._t_last.get(id(req), req.arrival_s)
        if not req.output_ids:
            return req.ttft_slo_s - (now - t_last)
        g = self.config.group_size
        n = g - (len(req.output_ids) - 1) % g  # tokens left in the current group
        return req.tpot_slo_s * n - (now - t_last) - (n - 1) * self.t_bar_s

    # ---------------------------------------------------------------- selection

    def select_batch(
        self,
        candidates: Sequence[Request],
        view: SchedulerView,
        cost: Callable[..., float] | None,
    ) -> list[Request]:
        now = view.now
        if cost is None:  # a scheduler built without a cost model: only B limits the batch
            cost = _free_iteration
        self._stamp(now)
        if not candidates:
            return []
        if cost is not self._cost:  # the scheduler passes the same callable every iteration
            self._cost, self._cost_swap = cost, _takes_swap_in(cost)
        batch = _Batch(cost, view, self._cost_swap)
        mem = _Memory(view)
        rt, be = [], []
        for r in candidates:
            (rt if r.service_class is ServiceClass.RT else be).append(r)
        limit = self.batch_limit
        # Only the `limit` most urgent RT requests can enter the batch: a partial sort.
        urgent = heapq.nsmallest(limit, [(self.remaining_s(r, now), r.seq, r) for r in rt])
        rem = {id(r): left for left, _, r in urgent}
        floor_s = cost(decode_context_lens=(1,))  # one bare iteration
        residual = math.inf
        early = False
        pending: list[Request] = []  # RT after the first one with a residual: all capped by it
        for left, _, r in urgent:
            if len(batch) + len(pending) >= limit:
                break
            if not mem.take_if_fits(r):  # l.5: only while blocks are available (else it waits)
                continue
            doomed = left < floor_s
            if doomed or not batch:
                batch.add(r)
                if not doomed:
                    residual = left
                continue
            if residual == math.inf:  # the first with a deadline to keep, after doomed ones
                if batch.time_with(r) > left:
                    mem.give(r)
                    early = True  # l.11–12: return the batch as it is
                    break
                batch.add(r)
                residual = left
                continue
            # Sorted by remaining time, every later request has at least `residual` left, so
            # the cap stays `residual`: l.6–15 add the longest prefix that fits, found below.
            pending.append(r)
        if pending:
            k = batch.add_prefix(pending, residual)
            for r in pending[k:]:
                mem.give(r)
            early = k < len(pending)  # l.11–12: the first that did not fit ends the batch
        if not early:
            self._be_phase(batch, mem, be, rem, residual, limit)
        chosen = batch.requests()
        self._adapt(early, view)
        t_iter = batch.time()
        self.t_bar_s += self.config.ema * (t_iter - self.t_bar_s)
        return chosen

    def _be_phase(
        self, batch: _Batch, mem: _Memory, be: list[Request], rem, residual: float, limit: int
    ):
        if not be:
            return
        view = batch.view
        checkpointed = getattr(view, "checkpointed_slots", None)
        slots = {id(r): checkpointed(r) if checkpointed else 0 for r in be}
        served = self._served_key()
        be.sort(key=lambda r: (served(r.client), slots[id(r)], r.arrival_s, r.seq))
        # Scheduled RT that could skip this iteration and still meet the next deadline.
        swappable = [r for r in batch.items if r.service_class is ServiceClass.RT]
        # While the batch only grows, T_iter only grows: BE work priced over the residual
        # stays over it, and so does any work at least as large (T_iter is monotone in each
        # of prefill tokens, cached prefix, decode context and swap-in). `too_slow` keeps the
        # smallest such works; a BE request dominated by one is skipped without pricing.
        too_slow = _Frontier()
        for b in be:
            if len(batch) < limit:
                work = batch.work_key(b)
                if too_slow.dominates(work):
                    continue
                if not mem.fits(b):
                    continue
                if batch.time_with(b) <= residual:
                    batch.add(b)
                    mem.take(b)
                else:
                    too_slow.add(work)
                continue
            while swappable:
                victim = swappable[-1]  # least urgent (sorted ascending by remaining)
                if rem[id(victim)] <= batch.time() + self.t_bar_s:
                    return  # no RT left with slack beyond the next iteration
                if batch.time_with(b, without=victim) > residual:
                    break
                if not mem.fits(b, without=victim):
                    break
                swappable.pop()
                batch.remove(victim)
                mem.give(victim)
                batch.add(b)
                mem.take(b)
                break
            else:
                return

    def _served_key(self) -> Callable[[str], float]:
        inner = self.inner
        if inner is None:
            return lambda client: 0.0
        if hasattr(inner, "counter"):
            return inner.counter  # VTC: least counter = least served
        return lambda client: -inner.deficit(client)  # DLPM: most deficit left

    def _adapt(self, early: bool, view: SchedulerView) -> None:
        cfg = self.config
        top = getattr(getattr(view, "config", None), "max_running_requests", 1 << 30)
        b0 = cfg.b0 if cfg.b0 is not None else top
        if early:
            self.batch_limit = b0
            self.num_early_returns += 1
        else:
            self.batch_limit = min(self.batch_limit + cfg.b_step, max(top, b0))


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

    def __init__(self, view: SchedulerView) -> None:
        self._room_of = getattr(view, "kv_room", None)
        self._need_of = getattr(view, "kv_need", None)
        self._ckpt = getattr(view, "checkpointed_slots", None)
        self._room: dict[ServiceClass, float] = {}
        self._needs: dict[int, int] = {}
        self.taken = 0

    def _need(self, req: Request) -> int:
        n = self._needs.get(id(req))
        if n is None:
            if req.phase is Phase.WAITING:
                n = self._need_of(req) if self._need_of is not None else 0
            else:
                n = self._ckpt(req) if self._ckpt is not None else 0
            self._needs[id(req)] = n
        return n

    def fits(self, req: Request, without: Request | None = None) -> bool:
        need = self._need(req)
        if not need or self._room_of is None:
            return True
        cls = req.service_class
        if cls not in self._room:
            self._room[cls] = self._room_of(req)
        freed = 0 if without is None else self._need(without)
        return self.taken - freed + need <= self._room[cls]

    def take_if_fits(self, req: Request) -> bool:
        """``take`` if ``fits``, in one call (the RT loop's common case)."""
        need = self._need(req)
        if not need:
            return True
        if not self.fits(req):
            return False
        self.taken += need
        return True

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
        return any(k == kind and a >= ka and b >= kb and swap >= ks for k, ka, kb, ks in self._keys)

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
        self, cost: Callable[..., float], view: SchedulerView, swap_ok: bool = False
    ) -> None:
        self.cost = cost
        self.view = view
        checkpointed = getattr(view, "checkpointed_slots", None) if swap_ok else None
        self._ckpt = checkpointed  # KV tokens a request has on the host (None: not counted)
        self._swap: dict[int, int] = {}  # id(req) -> tokens to swap in before it runs
        self.items: list[Request] = []
        self._chunks: dict[int, tuple[int, int]] = {}  # id(req) -> prefill chunk
        self._decodes: dict[int, int] = {}  # id(req) -> context length
        self._chunk_list: list[tuple[int, int]] = []  # the values above, in a list each
        self._decode_list: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def _work(self, req: Request) -> tuple[tuple[int, int] | None, int | None]:
        if req.phase is Phase.RUNNING:
            return None, req.seq_len
        cached = min(self.view.prefix_len(req), req.seq_len - 1)
        return (req.seq_len - cached, cached), None

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
        self._chunk_list = list(self._chunks.values())  # rare (a swap): rebuild
        self._decode_list = list(self._decodes.values())
        self._swap.pop(id(req), None)

    def time(self, extra: Request | None = None, without: Request | None = None) -> float:
        if without is None:  # the common case: the batch's own lists, no copy
            chunks, decodes = self._chunk_list, self._decode_list
            swap = sum(self._swap.values()) if self._swap else 0
        else:
            gone = id(without)
            chunks = [v for k, v in self._chunks.items() if k != gone]
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
