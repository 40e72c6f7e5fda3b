"""The share guard: fairness at the moment of arrival, not only in the admission order.

VTC, DLPM and FairServe decide *who is admitted next*. Once one tenant's flood holds the
running batch and the KV pool, that order does not help a newcomer: its request waits at
the back of a blocked walk until one of the flood's long decodes finishes (issue 16: a
well-behaved tenant's TTFT went from 0.01 s to 13 s). The guard shares what is held *now*.

A client's **share** is its dominant share of the two things a running request holds,
divided by its weight (the policy's ``weights``, 1 when it has none)::

    share(c) = max(KV tokens c's running requests hold / KV capacity,
                   c's running requests / max_running_requests) / weight(c)

Two rules, both applied only with ``SchedulerConfig.share_guard`` (the live server turns it
on for fair policies; the papers' experiments keep it off):

1. **Admission blocked.** When the walk stops for lack of room (SGLang stops at the first
   request that does not fit, so a flood's big prompt at the head blocks everyone), the
   waiting client with the smallest share gets its earliest waiting request admitted past
   it. If that request does not fit either, running requests of the
   client with the largest share are retracted for it (SGLang's victim rule inside that
   client: fewest output tokens, then longest prompt) — planned first, and only if the plan
   makes it fit — while the victim's client keeps at least the newcomer's share *after* the
   move and the newcomer is owed the room (``owed_room``): over a cluster, it has fewer calls
   in flight than the victim's client (the router's counts, ``Request.cluster_inflight``, per
   weight); else, for a policy with a ``service_received`` measure (VTC's counter, DLPM's and
   FairServe's), it has not received more service here. So no client is pushed below the one
   it made room for. Why the cluster's count first: a worker's counters see only its own
   share of a client. A flood spread over two servers and a victim with one call in flight
   hold one running slot each on the victim's server; there the two counters are level, and
   whichever is ahead by a request's charge wins, so the victim waited for a flood request
   to finish in about half its calls (side by side with SGLang's stack, its TTFT P99 was 4×
   SGLang's). Over the cluster the flood holds three slots of four and 24 calls to its one.
2. **Decode out of memory.** The victim of a retraction comes from the client with the
   largest share (SGLang's rule inside it), so the tenant that holds the most gives way.

Counters stay right because a retraction is not a new service: a re-admitted request is not
charged its prefill again (``on_admitted`` sees ``num_retractions > 0``), its generated
tokens were charged once as they came out, and its prompt's KV stays in the radix cache
until evicted. The cost is the victim's recomputation, bounded by one request per rule-1
admission of a starving client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from sgl_fair.policies.base import group_by_client
from sgl_fair.request import ClientId, Request

if TYPE_CHECKING:
    from sgl_fair.worker.engine import PrefillChunk
    from sgl_fair.worker.scheduler_state import SchedulerCore


class Shares:
    """Per-client KV tokens and running requests of a scheduler's running set."""

    def __init__(self, sched: SchedulerCore) -> None:
        self.capacity = max(sched.kv.capacity_tokens, 1)
        self.slots = max(sched.config.max_running_requests, 1)
        weights = sched.policy_caps.weights
        self._weights = weights
        self.kv: dict[ClientId, int] = {}
        self.count: dict[ClientId, int] = {}
        held: Iterable[Request] = sched.running
        if sched.chunked is not None:
            held = [*sched.running, sched.chunked]
        for r in held:
            self.add(r.client, r.num_computed, 1)

    def add(self, client: ClientId, tokens: int, requests: int) -> None:
        self.kv[client] = self.kv.get(client, 0) + tokens
        self.count[client] = self.count.get(client, 0) + requests

    def weight(self, client: ClientId) -> float:
        return self._weights.get(client, 1.0)

    def share(self, client: ClientId, tokens: int = 0, requests: int = 0) -> float:
        """``client``'s share with ``tokens``/``requests`` more (negative: fewer)."""
        return dominant_share(self.count.get(client, 0) + requests, self.slots,
                              self.kv.get(client, 0) + tokens, self.capacity,
                              self.weight(client))  # fmt: skip


def dominant_share(requests: int, slots: int, kv: int, capacity: int, weight: float) -> float:
    """A client's share: the larger of its share of running slots and of KV, ÷ its weight
    (the SGLang plugin's guard, ``worker/sglang/share_preempt.py``, uses it too)."""
    return max(requests / slots, kv / capacity) / weight


def owed_room(
    c: ClientId,
    mine: int | None,
    k: ClientId,
    theirs: int | None,
    service: Callable[[ClientId], float] | None,
    weight: Callable[[ClientId], float],
) -> bool:
    """Whether client ``c`` may take room from client ``k`` (rule 1). ``mine``/``theirs``:
    their calls in flight over the cluster (``Request.cluster_inflight`` of c's newcomer and
    of k's latest request here, ``latest_inflight``). Where both are known, by the cluster:
    ``c`` has fewer per weight. Else by the policy's ``service`` measure, where it has one:
    ``c`` has not received more than ``k``."""
    if mine is not None and theirs is not None:
        return mine / weight(c) < theirs / weight(k)
    return service is None or service(c) <= service(k)


def latest_inflight(requests: Iterable[Request]) -> int | None:
    """The router's count carried by the latest-arriving of ``requests`` (None: none has one)."""
    latest = max((r for r in requests if r.cluster_inflight is not None),
                 key=Request.arrival_key, default=None)  # fmt: skip
    return None if latest is None else latest.cluster_inflight


def decode_victim(sched: SchedulerCore, pool: Sequence[Request]) -> Request:
    """Rule 2: whom to retract from ``pool`` under memory pressure: one of the requests of
    the client in ``pool`` holding the largest share (SGLang's rule among them)."""
    shares = Shares(sched)
    top = max({r.client for r in pool}, key=lambda c: (shares.share(c), c))
    return sched.retraction.default_victim([r for r in pool if r.client == top])


def admit_below_share(
    sched: SchedulerCore, budget: int, num_active: int, promised: int
) -> list[PrefillChunk]:
    """Rule 1: admit the least-sharing waiting client's next request, making room if fair.

    Called after a walk that stopped for lack of room; returns the chunk(s) admitted (empty
    when nothing was fair to take).
    """
    if budget <= 0 or not sched.running or not sched.waiting:
        return []
    shares = Shares(sched)
    groups = group_by_client(sched.waiting)
    newcomer = min(groups, key=lambda c: (shares.share(c), groups[c][0].arrival_key()))
    # Its earliest request. Not the policy's ``order`` over the newcomer alone: a walk may
    # change policy state as it goes (DLPM replenishes the deficits of the clients it walks),
    # and a walk over one client would credit that client alone.
    req = groups[newcomer][0]
    clip = sched.config.clip_max_new_tokens
    tokens = req.all_ids()
    cached = min(sched.prefix_len(req), len(tokens) - 1)
    need = len(tokens) - cached + min(req.remaining_new_tokens, clip)
    target = shares.share(newcomer, len(tokens), 1)
    cfg = sched.config
    service = sched.policy_caps.service_received

    room = sched.kv.available_tokens() - sched.admission.reserved_tokens() - promised
    short_kv = need - room
    short_slots = num_active + 1 - cfg.max_running_requests
    ratio = sched.new_token_ratio
    # Plan first, retract after: a retraction that does not make room for the newcomer would
    # only hand the room straight back to the victim's client (thrashing).
    plan: list[Request] = []
    taken: set[int] = set()
    while short_kv > 0 or short_slots > 0:
        others = [c for c in shares.count if c != newcomer and shares.count[c] > 0]
        if not others:
            return []
        top = max(others, key=lambda c: (shares.share(c), c))
        pool = [r for r in sched.running if r.client == top and id(r) not in taken]
        if not pool:  # its only held request is the chunked one, which is not retractable
            return []
        victim = sched.retraction.default_victim(pool)
        if shares.share(top, -victim.num_computed, -1) < target:
            return []  # taking more from `top` would push it below the newcomer
        theirs = latest_inflight(pool)
        if not owed_room(newcomer, req.cluster_inflight, top, theirs, service, shares.weight):
            return []  # the newcomer is the heavier client over the cluster, or here
        shares.add(top, -victim.num_computed, -1)
        plan.append(victim)
        taken.add(id(victim))
        # Its KV becomes free or evictable, and its output reservation is released.
        short_kv -= victim.num_computed + ratio * min(victim.remaining_new_tokens, clip)
        short_slots -= 1
    for victim in plan:
        sched.retraction.retract(victim)
    sched.stats.num_share_retractions += len(plan)
    return sched.admission.admit(budget, num_active - len(plan), promised, walk=iter([req]))
