"""Our local policy inside SGLang 0.5.23's scheduler: the order it admits in, the counters it keeps.

SGLang's admission (``Scheduler._get_new_batch_prefill_raw``) is::

    self.policy.calc_priority(self.waiting_queue, running_batch, ...)   # sorts in place
    for req in self.waiting_queue:                                      # walks by index
        req.init_next_round_input(self.tree_cache)
        res = adder.add_one_req(req, ...)                               # may commit req
        if res != AddReqResult.CONTINUE: break

Our policies choose lazily: after each admission the policy is charged, then it picks the next
request (VTC's least counter, DLPM's deficit walk). ``FairSchedulePolicy.calc_priority`` puts
the policy's first choice at the head of the queue, and a hook after every ``add_one_req``
charges what was really admitted (extend tokens = fill length - matched prefix) and moves the
policy's next choice into the slot the loop reads next (CPython's list iterator reads by
index, so the loop sees it). The order is the pure policy's, for any queue length: SGLang's
own LPM falls back to FCFS above 128 waiting requests; this never does.

Accounting follows what SGLang did, through ``Ledger``: arrivals (``_add_request_to_queue``;
a policy's refusal aborts the request with HTTP 429), admissions (above), output tokens after
every batch result (any count per step: speculative decoding), finishes, aborts (queued:
``abort_request`` and any other removal from the queue; running: the abort finish reason) and
retractions (``ScheduleBatch.retract_decode``). Each SGLang ``Req`` has a mirror
``sgl_fair.request.Request`` that the policy sees; the client id is the request's
``routing_key`` (never ``extra_key``, which partitions SGLang's prefix cache).

Prefix matches (DLPM, LPM) come from ``shadow.py``: our radix tree following SGLang's cache
through its KV event recorder (``RadixCache``) or its published KV events
(``shadow_events.py``: ``UnifiedRadixCache``, the server default), with memoised matches, so
a pass over a deep queue re-matches only the requests whose tree path changed; SGLang's
``match_prefix`` per request per pass (``prefix_len`` below) remains for caches and requests
the shadow cannot follow. Both give the same lengths.

``plugin.py`` installs the hooks; this module holds what they call, so tests drive the same
code with SGLang's real ``Req``, ``RadixCache`` and ``PrefillAdder`` on a CPU.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import msgspec
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, SchedulePolicy
from sglang.srt.mem_cache.common import match_kv_cache

from sgl_fair.policies.base import Policy
from sgl_fair.request import Request
from sgl_fair.worker.sglang import shadow as shadow_mod
from sgl_fair.worker.sglang import shadow_events
from sgl_fair.worker.sglang.hook_errors import HookErrors
from sgl_fair.worker.sglang.ledger import Ledger
from sgl_fair.worker.sglang.lpm_index import LpmIndex
from sgl_fair.worker.sglang.profile import record_drain
from sgl_fair.worker.sglang.share_preempt import SharePreemption

log = logging.getLogger("sgl_fair.sglang")

# tree cache id -> the adapter of the scheduler that owns it (one per scheduler process; a
# PrefillAdder and a ScheduleBatch reach their scheduler's adapter through their tree_cache).
_ADAPTERS: dict[int, FairSchedulePolicy] = {}

_arrival = operator.attrgetter("arrival_s", "seq")  # arrival order of mirrors


def adapter_for(tree_cache: Any) -> FairSchedulePolicy | None:
    return _ADAPTERS.get(id(tree_cache))


# Where the shadow cannot answer (KV events off, attention TP, namespaced
# requests), a pass matches at most this many waiting requests on SGLang's own tree, as
# SGLang's LPM matches none beyond 128 waiting; the rest keep the length of their last match.
EXACT_MATCHES_PER_PASS = 128


class _View:
    """The ``SchedulerView`` our policy orders with: prefix matches against SGLang's cache."""

    def __init__(
        self,
        adapter: FairSchedulePolicy,
        running: Sequence[Request],
        groups: Callable[[], dict[str, list[Request]]] | None = None,
        whole_queue: bool = False,
    ) -> None:
        self._adapter = adapter
        self._groups = groups
        self._whole = whole_queue  # ordering every waiting request: lpm_groups may answer
        self._req_of = adapter.ledger.req_of
        self._shadow = adapter.shadow if adapter._shadow_on else None
        self.running = running
        self.now = adapter.ledger.clock()
        self._exact = 0  # SGLang's own matches this pass (no shadow for the request)

    def prefix_len(self, m: Request) -> int:
        req = self._req_of(m)
        shadow = self._shadow
        if shadow is not None and not shadow.dirty and shadow.handles(req):
            return shadow.prefix_len(req, m.input_ids)
        cap = self._adapter.exact_cap
        if cap is not None and self._exact >= cap:  # as SGLang bounds its own: no more walks
            self._adapter.num_capped += 1  # of its tree this pass; the last match it made
            return int(getattr(req, "prefix_len", 0) or 0)
        self._exact += 1
        return self._adapter.prefix_len(req)

    def waiting_by_client(self) -> dict[str, list[Request]] | None:
        """The waiting mirrors per client as the ledger keeps them (``waiting_groups``)."""
        return self._groups() if self._groups is not None else None

    def lpm_groups(self) -> dict[str, Any] | None:
        """The waiting clients' mirrors in LPM order, kept across passes (``lpm_index.py``):
        only for the whole waiting set, on the shadow; None otherwise (``lpm_order``)."""
        index, shadow = self._adapter.lpm_index, self._shadow
        if index is None or shadow is None or not self._whole:
            return None
        index.synced = True
        return index.groups(self._adapter.ledger.waiting, shadow, self.prefix_len, self._req_of)

    def prefix_lens(self, ms: Sequence[Request]) -> list[int]:
        """``prefix_len`` of each of ``ms`` (``lpm_order`` asks for a whole queue): memo hits
        in one loop (a hit was matched on the shadow, so the shadow handles it), the rest
        one by one, exactly once the shadow turns dirty."""
        shadow = self._shadow
        if shadow is None or shadow.dirty:
            return [self.prefix_len(m) for m in ms]
        lens = shadow.prefix_lens(list(map(self._req_of, ms)))
        for i, n in enumerate(lens):
            if n is None or shadow.dirty:
                lens[i] = self.prefix_len(ms[i])
        return lens  # type: ignore[return-value]


class FairSchedulePolicy(SchedulePolicy):
    """SGLang's ``SchedulePolicy`` with our policy's order (SGLang's other helpers inherited)."""

    def __init__(
        self,
        policy: Policy,
        tree_cache: Any,
        *,
        enable_hierarchical_cache: bool = False,
        clock: Callable[[], float] = time.monotonic,
        shadow: bool = True,
        low_priority_first: bool = False,
    ) -> None:
        super().__init__("fcfs", tree_cache, enable_hierarchical_cache, False, False)
        self.fair = policy
        self.ledger = Ledger(policy, clock, low_priority_first)
        self._queue: list[Req] | None = None
        self._walk: Iterator[Request] | None = None
        self._expect: Req | None = None  # the policy's current choice, at self._pos
        self._pos = 0
        self.num_walks = 0
        self.num_resyncs = 0
        self.num_capped = 0  # prefix lengths not matched this pass: past the bound
        self.exact_cap: int | None = EXACT_MATCHES_PER_PASS  # None: every one (an oracle)
        self.errors = HookErrors()  # our hooks' failures, per hook (hook_errors.py)
        # The share guard through SGLang's priority preemption (share_preempt.py): set by the
        # plugin where the policy shares running slots and the server preempts by priority.
        self.share: SharePreemption | None = None
        self._newcomer = False  # the walk's current placement is rule 1's newcomer
        self.num_newcomers = 0  # newcomers placed ahead of the policy's choice
        self._running_batch: Any = None
        self._adder: Any = None  # this pass's PrefillAdder, once SGLang has used it
        # Prefix matches for the policy: memoised against a shadow of the cache (shadow.py)
        # where the cache is one it can follow, else SGLang's own match_prefix.
        self.shadow: shadow_mod.ShadowCache | None = None  # or its EventShadow subclass
        self._shadow_on = False
        if shadow:
            why_not = shadow_mod.supported(tree_cache)
            why_not_events = shadow_events.supported(tree_cache) if why_not else None
            if why_not is None:
                self.shadow = shadow_mod.ShadowCache(tree_cache)
            elif why_not_events is None:  # the unified cache: follow its KV events
                self.shadow = shadow_events.EventShadow(tree_cache)
            else:
                log.info(
                    "sgl-fair: exact prefix matches (no shadow cache): %s; %s",
                    why_not,
                    why_not_events,
                )
        # The LPM order kept across passes, on the shadow (lpm_index.py).
        self.lpm_index: LpmIndex | None = None
        if self.shadow is not None:
            self.lpm_index = LpmIndex()
            self.ledger.waiting.track()
        _ADAPTERS[id(tree_cache)] = self

    def disable_shadow(self) -> None:
        """Back to SGLang's exact ``match_prefix`` per request per pass (the bench's baseline)."""
        if self.shadow is not None:
            self.shadow.detach()
        self.shadow = None
        self._shadow_on = False
        self.lpm_index = None
        self.ledger.waiting.untrack()

    def detach(self) -> None:
        self._close_walk()
        self.disable_shadow()
        if _ADAPTERS.get(id(self.tree_cache)) is self:
            del _ADAPTERS[id(self.tree_cache)]

    # ---- SchedulePolicy ---------------------------------------------------------------------

    def calc_priority(
        self,
        waiting_queue: list[Req],
        running_batch: Any = None,
        processed_tokens: int = 0,
    ) -> None:
        """Put the policy's first choice at the head; later choices follow admissions. On
        an error, SGLang admits this pass in the queue's order (counted, ``hook_errors``)."""
        try:
            self._calc_priority(waiting_queue, running_batch)
        except Exception:  # noqa: BLE001 - an exception here ends SGLang's scheduler loop
            self.errors.failed("calc_priority")
            self._close_walk()

    def _calc_priority(self, waiting_queue: list[Req], running_batch: Any) -> None:
        self._close_walk()
        ledger = self.ledger
        exact = ledger.reconcile_waiting(waiting_queue)
        if not waiting_queue:
            return
        strangers: list[Req] = []
        groups = None
        reqs: list[Req] | None = None
        if exact:  # the queue is the waiting set: its order kept, no lookup per request
            mirrors = ledger.waiting.in_order()  # (waiting_set.py)
            groups = ledger.waiting.groups
            reqs = ledger.waiting.hosts()  # type: ignore[assignment]
        else:
            held = ledger.mirrors_of(waiting_queue)
            if None in held:  # requests the ledger does not hold (its policy refused them
                # after SGLang queued them): never ordered, they wait behind the rest
                strangers = [r for r, m in zip(waiting_queue, held, strict=True) if m is None]
                held = [m for m in held if m is not None]
            mirrors = sorted(held, key=_arrival)  # a queued mirror not waiting: moved unseen
        running = [
            m
            for r in (running_batch.reqs if running_batch is not None else ())
            if (m := ledger.mirror(r)) is not None
        ]
        self._shadow_on = self.shadow is not None and not envs.SGLANG_RADIX_FORCE_MISS.get()
        if self._shadow_on:
            self.shadow.begin_pass(waiting_queue)
        index = self.lpm_index
        if index is not None:
            if not index.synced:  # the last pass ordered without it: its logs are stale
                index.drain(ledger.waiting, self.shadow)
            index.synced = False
        self._running_batch = running_batch
        self._adder = None
        self._queue = waiting_queue
        self._walk = self.fair.order(mirrors, _View(self, running, groups, whole_queue=exact))
        self.num_walks += 1
        # Until the walk picks them, the rest wait in arrival order.
        if reqs is None:
            reqs = [*map(ledger.reqs_by_mirror_id.__getitem__, map(id, mirrors)), *strangers]
        waiting_queue[:] = reqs
        self._pos = 0
        self._expect = None
        self._place_next(0)

    def prefix_len(self, req: Req) -> int:
        """Tokens of ``req`` cached on this worker (SGLang's own match, as its LPM does): the
        exact path, used without a shadow cache."""
        match_kv_cache(req, self.tree_cache, req.origin_input_ids + req.output_ids)
        return int(req.prefix_len)

    # ---- hooks --------------------------------------------------------------------------------

    def close_walk(self) -> None:
        """Stop ordering this pass: SGLang admits the rest in the queue's order."""
        self._close_walk()

    def report(self) -> dict[str, Any]:
        """What the scheduler's internal state shows of the plugin (``plugin.py``)."""
        return {"policy": self.fair.name, "hook_errors": dict(self.errors.counts),
                "held": len(self.ledger), "rejected": self.ledger.num_rejected,
                "shadow": self.shadow is not None,
                "share_preemptions_marked": None if self.share is None
                else self.share.num_marked,
                "share_newcomers": None if self.share is None else self.num_newcomers,
                "service": msgspec.to_builtins(self.ledger.service_report())}  # fmt: skip

    def after_add_one_req(self, adder: Any, req: Req, result: AddReqResult) -> None:
        """``PrefillAdder.add_one_req`` returned: charge an admission, place the next choice."""
        admitted = bool(adder.can_run_list) and adder.can_run_list[-1] is req
        self._adder = adder
        if admitted:
            extend = len(req.full_untruncated_fill_ids) - int(req.prefix_len)
            self.ledger.admitted(req, extend)
        if self._walk is None or self._queue is None:
            return
        if result != AddReqResult.CONTINUE:
            self._close_walk()  # the loop stops here
            return
        queue = self._queue
        if self._newcomer:  # rule 1's newcomer, not the policy's choice: the walk starts again
            self._newcomer = False
            pos = _index(queue, req, self._pos) if req is self._expect else -1
            if pos < 0:
                self._close_walk()
                return
            self._restart_walk(pos + 1)
            return
        if req is not self._expect:
            # SGLang skipped our choice (LoRA slots, pooling mode, a pending prefetch) and
            # tried the next slot: restart the walk from what is left after it.
            self.num_resyncs += 1
            pos = _index(queue, req, self._pos)
            if pos < 0:
                self._close_walk()
                return
            self._restart_walk(pos + 1)
            return
        self._place_next(self._pos + 1)

    def after_batch(self, batch: Any) -> None:
        for req in batch.reqs:
            self.ledger.after_step(req)
        if self.shadow is not None:  # the KV events this result made, off the admission step
            t0 = time.perf_counter()
            n = self.shadow.drain()
            if n:
                record_drain(time.perf_counter() - t0, n)

    def after_retract(self, retracted: Sequence[Req], aborted: Sequence[Req]) -> None:
        for req in retracted:
            self.ledger.retracted(req)
        for req in aborted:
            self.ledger.aborted(req, reason="aborted at retraction")

    # ---- the walk -----------------------------------------------------------------------------

    def _place_next(self, pos: int) -> None:
        """Pull the policy's next choice and move it to ``pos``."""
        assert self._walk is not None and self._queue is not None
        queue = self._queue
        choice = next(self._walk, None)
        if choice is None or pos >= len(queue):
            self._expect = None
            self._close_walk()
            return
        req = self.ledger.req_of(choice)
        j = _index(queue, req, pos)
        if j < 0:  # not in the queue any more: cannot happen between hooks; stop ordering
            self._close_walk()
            return
        if j != pos:
            queue.insert(pos, queue.pop(j))
        self._pos = pos
        self._expect = req
        share, batch = self.share, self._running_batch
        if share is not None and batch is not None and batch.reqs:
            adder = self._adder
            admitted = adder.can_run_list if adder is not None else ()
            if share.mark(req, batch.reqs, admitted) is None and share.full(batch.reqs, admitted):
                self._place_newcomer(pos, batch.reqs, admitted)

    def _place_newcomer(self, pos: int, running: Sequence[Req], admitted: Sequence[Req]) -> None:
        """Every slot taken and the policy's choice owed none: rule 1's newcomer, if owed one
        (``SharePreemption.newcomer``), goes first; once admitted the walk restarts."""
        assert self.share is not None and self._queue is not None
        req_of = self.ledger.req_of
        firsts = sorted(self.ledger.waiting.earliest().values(), key=_arrival)
        earliest = {m.client: req_of(m) for m in firsts}  # in arrival order
        req = self.share.newcomer(earliest, running, admitted)
        if req is None:
            return
        queue = self._queue
        j = _index(queue, req, pos)
        if j < 0:  # not in this pass's queue (the ledger's set may hold more): no move
            self.share.restore()
            return
        queue.insert(pos, queue.pop(j))
        self._expect = req
        self._newcomer = True
        self.num_newcomers += 1

    def _restart_walk(self, pos: int) -> None:
        assert self._queue is not None
        self._close_walk(keep_queue=True)
        rest = [m for r in self._queue[pos:] if (m := self.ledger.mirror(r)) is not None]
        rest.sort(key=_arrival)
        self._walk = self.fair.order(rest, _View(self, []))
        self._place_next(pos)

    def _close_walk(self, keep_queue: bool = False) -> None:
        if self.share is not None:
            self.share.restore()  # before SGLang queues what it preempted again
        walk = self._walk
        self._walk = None
        self._expect = None
        self._newcomer = False
        if not keep_queue:
            self._queue = None
        if isinstance(walk, Generator):  # the policy's lazy walk: run its cleanup now
            walk.close()


def _index(queue: list[Req], req: Req, start: int) -> int:
    """Where ``req`` (this object) is in ``queue[start:]``, -1 if not: ``list.index`` scans in
    C (``Req`` compares by identity); the check keeps it exact should ``Req`` ever define
    ``__eq__``."""
    try:
        i = queue.index(req, start)
    except ValueError:
        return -1
    if queue[i] is req:
        return i
    return next((j for j in range(i + 1, len(queue)) if queue[j] is req), -1)
