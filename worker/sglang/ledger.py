"""SGLang's requests as our policy sees them (the plugin's ledger): one mirror per live
request, keyed by identity, and every event that charges or releases it — arrival,
admission, tokens, finish, abort, retraction — plus the waiting mirrors kept in arrival
order and per client (``waiting_set.py``). Used by the adapter (``adapter.py``).

Beside it, the server's **service ledger** (``worker/service_ledger.py``, as a standalone
worker keeps one): a request a router replica tagged (``TAG_PARAM``: ``(replica, charge)``)
is charged to that replica's (replica, client) row when it arrives, and its output when it
ends, however it ends; ``service_report`` is the snapshot ``/server_info`` shows, which each
replica's bridge reads and sends with its ``Load`` — so router replicas over SGLang servers
share D2LPM's deficits as over standalone workers (``docs/replicas.md``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from sgl_fair.messages import ServiceReport
from sgl_fair.policies.base import Policy, Rejection
from sgl_fair.request import Phase, Request
from sgl_fair.worker.service_ledger import ServiceLedger
from sgl_fair.worker.sglang.mirror import mirror_of, tag_of
from sgl_fair.worker.sglang.waiting_set import WaitingSet

Req = Any  # sglang.srt.managers.schedule_batch.Req (not imported here)


class Ledger:
    """SGLang's requests as our policy sees them: one mirror per live request, and every
    event that charges or releases it. Events are idempotent: a request finishes once.

    Keyed by identity, never by rid: SGLang holds two live requests under one rid (across
    tokenizer workers, in its rid-reuse windows), and each is its own request here."""

    def __init__(
        self,
        policy: Policy,
        clock: Callable[[], float] = time.monotonic,
        low_priority_first: bool = False,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.low_priority_first = low_priority_first  # SGLang's priority direction
        # id(Req) -> mirror, while SGLang holds the request: a pass looks its queue up by
        # identity, and never reads an attribute of a request it does not order (cold
        # objects, deep queues). id(mirror) -> SGLang's Req, for the same entries.
        self._by_id: dict[int, Request] = {}
        self._req_of: dict[int, Req] = {}
        self.waiting = WaitingSet()  # the WAITING mirrors, in arrival order and per client
        self.dirty = False  # queued requests may have left (an abort): reconcile
        self.num_rejected = 0
        self.service = ServiceLedger()  # keyed by id(Req), as the mirrors are

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def mirrors(self) -> dict[str, Request]:
        """rid -> mirror of the requests held (one of them where two share a rid): for
        reading, not on a pass's path."""
        return {m.rid: m for m in self._by_id.values()}

    def req_of(self, m: Request) -> Req:
        """SGLang's request behind a mirror this ledger holds."""
        return self._req_of[id(m)]

    @property
    def reqs_by_mirror_id(self) -> dict[int, Req]:
        """id(mirror) -> SGLang's request, for lookups in C (``map``) on a pass's path."""
        return self._req_of

    def mirror(self, req: Req) -> Request | None:
        return self._by_id.get(id(req))  # this very Req's mirror (its id is ours while held)

    def mirrors_of(self, reqs: Sequence[Req]) -> list[Request | None]:
        """``mirror`` of each request, looked up by identity alone."""
        return list(map(self._by_id.get, map(id, reqs)))

    def arrived(self, req: Req) -> Rejection | None:
        """A new request joins the waiting queue; the policy may refuse it. A running one
        queued again without passing ``retract_decode`` (SGLang's priority preemption puts
        the running requests it preempts back through ``_add_request_to_queue``) is retracted."""
        m = self.mirror(req)
        if m is not None:
            if m.phase is Phase.RUNNING:
                self.retracted(req)
            return None
        now = self.clock()
        m = mirror_of(req, now, self.low_priority_first)
        rejection = self.policy.on_arrival(m, now)
        tag = tag_of(req)
        if rejection is not None:
            m.phase = Phase.REJECTED
            m.reject_reason = rejection.reason
            self.num_rejected += 1
            if tag is not None:  # its replica charged it: so does its row
                self.service.refused(tag[0], m.client, tag[1])
            return rejection
        self._by_id[id(req)] = m
        self._req_of[id(m)] = req
        self.waiting.add(m, req)
        if tag is not None:
            self.service.received(id(req), tag[0], m.client, tag[1], interaction=m.interaction_id)
        return None

    def admitted(self, req: Req, extend_len: int) -> None:
        m = self.mirror(req)
        if m is None or m.phase is not Phase.WAITING:
            return
        first = m.num_retractions == 0
        m.phase = Phase.RUNNING
        self.waiting.remove(m)
        m.prefix_len = int(req.prefix_len)
        if first:
            m.first_prefix_len = m.prefix_len
            m.admit_s = self.clock()
        self.policy.on_admitted(m, extend_len if first else 0)

    def sync_tokens(self, req: Req) -> int:
        """Charge the output tokens SGLang appended since the last sync (1, or several with
        speculative decoding); returns how many."""
        m = self.mirror(req)
        if m is None or m.phase is not Phase.RUNNING:
            return 0
        out = req.output_ids
        n = len(out) - m.num_output
        if n > 0:
            m.output_ids.extend(out[m.num_output :])
            if m.first_token_s is None:
                m.first_token_s = self.clock()
            self.policy.on_tokens(m, n)
        return max(n, 0)

    def after_step(self, req: Req) -> None:
        """After a batch result: charge new tokens; settle the request if it finished."""
        self.sync_tokens(req)
        if req.finished():
            reason = req.finished_reason
            if type(reason).__name__ == "FINISH_ABORT":
                self.aborted(req, reason=getattr(reason, "message", "aborted"))
            else:
                self.finished(req)

    def finished(self, req: Req) -> None:
        m = self._pop(req)
        if m is None:
            return
        m.phase = Phase.FINISHED
        m.finish_s = self.clock()
        self.policy.on_finished(m)

    def aborted(self, req: Req, reason: str = "aborted") -> None:
        """Cancelled: queued (never admitted, or retracted) or running; charges stay."""
        m = self._pop(req)
        if m is None:
            return
        waiting = m.phase is Phase.WAITING
        m.phase = Phase.ABORTED
        m.abort_reason = reason
        m.finish_s = self.clock()
        self.policy.on_aborted(m, waiting)

    def retracted(self, req: Req) -> None:
        m = self.mirror(req)
        if m is None or m.phase is not Phase.RUNNING:
            return
        self.sync_tokens(req)
        m.phase = Phase.WAITING
        self.waiting.add(m, req)
        m.num_retractions += 1
        self.policy.on_retracted(m)

    def reconcile_waiting(self, waiting_queue: Sequence[Req]) -> bool:
        """Requests that left the queue without being admitted (aborted, timed out, pushed out
        by the queue limit) leave the policy too; queued requests it never saw arrive now.
        Set operations over identities (in C): a pass pays per request that changed, not
        per request queued. True when, after it, the queue holds exactly the waiting mirrors'
        requests (every queued one held and waiting, none missing): ``waiting`` is then the
        queue, in arrival order, with no per-request lookup."""
        self.dirty = False
        by_id = self._by_id
        queued = set(map(id, waiting_queue))
        waiting = Phase.WAITING
        req_of = self._req_of
        for i in by_id.keys() - queued:  # the running ones, and any that left the queue
            m = by_id[i]
            if m.phase is waiting:
                self.aborted(req_of[id(m)], reason="left the waiting queue")
        if not queued <= by_id.keys():  # some it never saw: in the queue's order
            for r in waiting_queue:
                if id(r) not in by_id:
                    self.arrived(r)  # a refusal here is ignored: SGLang already queued it
            if not queued <= by_id.keys():
                return False  # refused ones stay queued: strangers
        # Every WAITING mirror is queued now (the rest were aborted above), so equal sizes
        # mean no queued request is a mirror in another phase, and no duplicate.
        return len(self.waiting) == len(waiting_queue) == len(queued)

    def _pop(self, req: Req) -> Request | None:
        m = self._by_id.pop(id(req), None)
        if m is not None:
            del self._req_of[id(m)]
            self.waiting.remove(m)
            self.service.sent(id(req), m.num_output)  # nothing for an untagged request
        return m

    def service_report(self) -> ServiceReport:
        """The service ledger's snapshot, every request held counted (tagged or not): each
        reader (one bridge per router replica) takes every row, so none is told only what
        changed since another read."""
        self.service.want_full()
        report = self.service.report()
        return msgspec.structs.replace(report, num_requests=len(self._by_id))
