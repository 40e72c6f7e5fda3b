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
* **Memory** (l.5: RT is added "while blocks are available (free or preemptible BE-only
  blocks)"): every pick must fit the scheduler's room (``view.kv_room``). On bidirectional
  blocks an RT request's room already counts the BE slots it may overwrite (lazy
  checkpointing) while host memory lasts. Beyond that, and on allocators without such
  blocks (token, paged), running BE requests' KV is preemptible by recompute: an RT pick may
  count what retracting them adds (``view.kv_freed_by``; on bidirectional blocks only what
  host memory running short kept out: SPEC §5's last resort), the BE requests it needs are
  left out of the BE phase, and the scheduler retracts them for the pick, fewest generated
  tokens first (``victim``). ``preempt_be=False``: it waits for free KV.
  ``recompute_blocked=True``: a chosen running request that finds no block for its next token
  is itself retracted (recompute), RT or BE — vLLM's way, and with ``preempt_be=False`` the
  paper's "No Bi-cache" baseline (§7.4); by default the scheduler retracts paused ones for it.
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
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sgl_fair.policies.base import BasePolicy, Rejection, SchedulerView, make_policy, register
from sgl_fair.policies.bros_batch import _Batch, _free_iteration, _Frontier, _Memory, _takes_swap_in
from sgl_fair.request import Phase, Request, ServiceClass

INNER_POLICIES = ("none", "vtc", "dlpm")


_BY_ARRIVAL = operator.attrgetter("arrival_s", "seq")  # Request.arrival_key, in C


def _victim_key(r: Request) -> tuple[bool, int]:
    """The larger, the sooner retracted: BE before RT, fewest generated tokens first."""
    return r.service_class is ServiceClass.BE, -r.num_output


def _unserved(client: str) -> float:
    """The BE phase's service key without an inner fairness policy: every client alike."""
    return 0.0


@register("bros")
class BROS(BasePolicy):
    asks_prefix_len = True  # its inner dlpm order does
    orders_by_time = True  # deadlines: TTFT/TPOT slack at view.now

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
        # An RT request that does not fit the free KV may take running BE requests' KV by
        # retracting them (recompute), on allocators where RT cannot overwrite BE slots
        # (token, paged); False: it waits for free KV (the bidirectional ablation's baseline).
        preempt_be: bool = True
        # A chosen running request that finds no KV block for its next token is retracted
        # and recomputed itself, RT or BE (vLLM's way; with preempt_be=False, the paper's "No
        # Bi-cache" baseline, §7.4); False: the scheduler retracts paused requests for it.
        recompute_blocked: bool = False

        def __post_init__(self) -> None:
            if (self.b0 is not None and self.b0 < 1) or self.b_step < 0 or self.group_size < 1:
                raise ValueError("bros: need b0 >= 1, b_step >= 0, group_size >= 1")
            if not 0 < self.ema <= 1:
                raise ValueError(f"bros: ema must be in (0, 1] (got {self.ema})")
            for name in ("preempt_be", "recompute_blocked"):
                if not isinstance(getattr(self, name), bool):
                    bad = getattr(self, name)
                    raise ValueError(f"bros: {name} must be true or false (got {bad!r})")
            if self.inner not in INNER_POLICIES:
                raise ValueError(
                    f"bros: inner must be one of {', '.join(INNER_POLICIES)} (got {self.inner!r})"
                )

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.batch_limit = cfg.b0 or 1 << 30  # B (clipped to max_running_requests per step)
        # Declared to the scheduler (worker/select_step.py): who loses KV when a block is short.
        self.recomputes_blocked = cfg.recompute_blocked
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
        return max(pool, key=_victim_key)

    @staticmethod
    def _preemptible(be: Sequence[Request]) -> list[Request]:
        """Running BE requests in the order ``victim`` retracts them: a stable sort, most
        retractable first, so ties keep the scheduler's order as ``max`` does."""
        running = [r for r in be if r.phase is Phase.RUNNING]
        running.sort(key=_victim_key, reverse=True)
        return running

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
        continued = getattr(view, "continued_chunk", None)
        chunk = continued() if continued is not None else None
        batch = _Batch(cost, view, self._cost_swap, chunk[:2] if chunk else None)
        if chunk is not None and not chunk[2]:  # the prompt goes on: this step admits nothing
            candidates = [r for r in candidates if r.phase is not Phase.WAITING]
        rt, be = [], []
        for r in candidates:
            (rt if r.service_class is ServiceClass.RT else be).append(r)
        mem = _Memory(view, (lambda: self._preemptible(be)) if self.config.preempt_be else None)
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
            # l.5: only while blocks are available, free or BE's (else it waits)
            if not (mem.take_if_fits(r) or mem.take_preempting(r)):
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
        mem.settle()
        if mem.claimed:  # retracted for the RT picks (select_step._make_room): not chosen
            be = [b for b in be if id(b) not in mem.claimed]
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
        slots = {id(r): checkpointed(r) for r in be} if checkpointed else {}
        served = self._served_key()
        if served is _unserved and not any(slots.values()):  # the paper's order: by arrival
            be.sort(key=_BY_ARRIVAL)
        else:
            be.sort(key=lambda r: (served(r.client), slots.get(id(r), 0), r.arrival_s, r.seq))
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
            return _unserved
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
