"""The share guard inside SGLang: a waiting client holding less than its share of the running
batch takes a slot from the client holding the most, through SGLang's own priority
preemption (*beyond the papers*; ``worker/share_guard.py``'s rule 1 for our engine).

Why. VTC, DLPM and FairServe decide who is admitted *next*. When one tenant's flood fills
every running slot of a server (``--max-running-requests``), the policy's first choice, a
newcomer, still waits for one of the flood's decodes to finish: side by side with SGLang's
stack (``bench/bench_sglang_side_by_side.py``, 2 running per server) the victim's TTFT P99 was
11× SGLang's, whose gateway happened to leave it a server of its own. No order of the waiting
queue helps; a running request has to give its slot up.

How. SGLang preempts for a waiting request when its running batch is full and priority
scheduling is on (``--enable-priority-scheduling``): ``PrefillAdder.preempt_to_schedule(req)``
releases running requests whose ``priority`` is worse than ``req``'s by more than
``--priority-scheduling-preemption-threshold`` (T), lowest first, and queues them again. So
whenever the plugin places its choice ``req`` at the head of the walk, :meth:`mark` decides
whether ``req``'s client may take a slot, and if so from which request, and says it in
priorities: ``req`` and every running request get the same value, the one victim a value
T + 1 worse; nothing else is preemptible. :meth:`restore` gives every request its own
priority back when the walk closes (before SGLang queues a preempted request again).

The rule is ``share_guard``'s, on SGLang's numbers. A client's share is its dominant share of
the running batch's slots (``max_running_requests``) and KV tokens (``max_total_num_tokens``;
a request holds its prompt and output), divided by its weight. ``req``'s client c may take a
slot from the client k with the largest share when k keeps at least c's share after the move
(so the move never reverses the order it corrects), and c is owed the room
(``share_guard.owed_room``): c has fewer calls in flight over the cluster than k, by the
router's counts our bridge sends (``INFLIGHT_PARAM``); for requests without them (not sent by
our router), c has not received more service than k on the policy's measure (VTC's counter,
DLPM's, FairServe's). The victim inside k is SGLang's:
fewest output tokens, then longest prompt. SGLang still checks that freeing it makes room
(else nothing is preempted). The ledger counts a preempted request as retracted
(``Ledger.arrived``): its prompt is not charged again when it is admitted again, its output
was charged as it came.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sgl_fair.request import ClientId, Request
from sgl_fair.worker.share_guard import dominant_share, latest_inflight, owed_room


class SharePreemption:
    def __init__(
        self,
        client_of: Callable[[Any], ClientId | None],
        *,
        threshold: int,
        low_priority_first: bool,
        slots: int,
        kv_capacity: int,
        weights: Mapping[ClientId, float] | None = None,
        service_received: Callable[[ClientId], float] | None = None,
        mirror: Callable[[Any], Request | None] | None = None,
    ) -> None:
        self.client_of = client_of  # the ledger's client of a SGLang Req (None: not ours)
        self.mirror = mirror  # the ledger's mirror of a SGLang Req (its cluster_inflight)
        self.threshold = max(int(threshold), 0)
        # The victim's priority, relative to the others' 0: worse by T + 1 in the server's
        # direction (smaller values first with --schedule-low-priority-values-first).
        self.victim_priority = (self.threshold + 1) * (1 if low_priority_first else -1)
        self.slots = max(int(slots), 1)
        self.kv_capacity = max(int(kv_capacity), 1)
        self.weights = dict(weights or {})
        self.service_received = service_received
        self._saved: list[tuple[Any, Any]] = []  # (req, its own priority) while marked
        self.num_marked = 0  # times a victim was marked (SGLang preempts it if room follows)

    def _share(self, count: int, kv: int, client: ClientId) -> float:
        weight = self.weights.get(client, 1.0)
        return dominant_share(count, self.slots, kv, self.kv_capacity, weight)

    def mark(self, req: Any, running: Sequence[Any], admitted: Sequence[Any] = ()) -> Any:
        """Mark the victim ``req`` may preempt among ``running`` (SGLang's running batch;
        ``admitted``: the requests this pass already admitted); returns it, or None."""
        self.restore()
        if len(running) + len(admitted) < self.slots:
            return None  # a free slot: SGLang preempts only for a full batch
        return self._mark(req, running, *self._holdings(running, admitted))

    def _mark(
        self, req: Any, running: Sequence[Any], count: dict[ClientId, int], kv: dict[ClientId, int]
    ) -> Any:
        """``mark`` with every slot taken and the holdings counted (``_holdings``)."""
        c = self.client_of(req)
        if c is None:
            return None
        pool: dict[ClientId, list[Any]] = {}
        for r in running:
            k = self.client_of(r)
            if k is not None and k != c and not r.finished():
                pool.setdefault(k, []).append(r)
        if not pool:
            return None
        shares = {k: self._share(count[k], kv[k], k) for k in pool}
        k = max(shares, key=lambda x: (shares[x], str(x)))
        victim = min(pool[k], key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        after_k = self._share(count[k] - 1, kv[k] - _held(victim), k)
        after_c = self._share(count.get(c, 0) + 1, kv.get(c, 0) + _held(req), c)
        if after_k < after_c:
            return None  # c would then hold more than k: not a correction
        mine = theirs = None
        if self.mirror is not None:
            m = self.mirror(req)
            mine = None if m is None else m.cluster_inflight
            theirs = latest_inflight(m for r in pool[k] if (m := self.mirror(r)) is not None)
        weight = self.weights.get
        if not owed_room(c, mine, k, theirs, self.service_received, lambda x: weight(x, 1.0)):
            return None  # c is the heavier client over the cluster, or has been served more
        for r in (req, *running):
            self._saved.append((r, r.priority))
            r.priority = 0
        victim.priority = self.victim_priority
        self.num_marked += 1
        return victim

    def full(self, running: Sequence[Any], admitted: Sequence[Any] = ()) -> bool:
        """Every running slot taken (only then does SGLang preempt)."""
        return len(running) + len(admitted) >= self.slots

    def newcomer(
        self, earliest: Mapping[ClientId, Any], running: Sequence[Any], admitted: Sequence[Any] = ()
    ) -> Any:
        """Rule 1's newcomer while every slot is taken: of ``earliest`` (each waiting client's
        earliest request, in arrival order), the one whose client holds the smallest share,
        the earliest of equals —
        marked for, if it is owed a slot (``mark``); else None. The walk places it ahead of
        the policy's choice, which no free slot can take (SGLang stops at the first request
        it cannot preempt for, so a choice not owed a slot would end the pass)."""
        if not self.full(running, admitted) or not earliest:
            return None
        count, kv = self._holdings(running, admitted)
        c = min(earliest, key=lambda x: self._share(count.get(x, 0), kv.get(x, 0), x))
        req = earliest[c]  # min keeps the first of equals: the earliest arrival
        self.restore()
        return req if self._mark(req, running, count, kv) is not None else None

    def _holdings(
        self, running: Sequence[Any], admitted: Sequence[Any]
    ) -> tuple[dict[ClientId, int], dict[ClientId, int]]:
        """Per client: the running slots and KV tokens it holds (``running`` and ``admitted``)."""
        count: dict[ClientId, int] = {}
        kv: dict[ClientId, int] = {}
        for r in (*running, *admitted):
            k = self.client_of(r)
            if k is not None and not r.finished():
                count[k] = count.get(k, 0) + 1
                kv[k] = kv.get(k, 0) + _held(r)
        return count, kv

    def restore(self) -> None:
        """Every marked request's own priority back."""
        for r, priority in reversed(self._saved):
            r.priority = priority
        self._saved.clear()


def _held(req: Any) -> int:
    """KV tokens ``req`` holds while it runs: its prompt and its output so far."""
    return len(req.origin_input_ids) + len(req.output_ids)


__all__ = ["SharePreemption"]
