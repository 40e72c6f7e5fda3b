"""The router core: dispatch decisions and the soft state behind them, with no clock of its own.

The simulator and the live server drive the same object; time is passed in::

    router.throttle(req, now) -> Rejection|None  cluster-level OIT (when built with ``oit=``)
    router.dispatch(req, now) -> Dispatch    match → policy.select → record → policy hook
    router.handle(msg, now)                  Tokens / Finished / Evicted / Load, as they come
    router.apply_kv_ops(u, ops, t_s)         SGLang-format KV events, decoded (kv_events.py)
    router.follow_kv(u, decoder, batch, t_s) the same, op by op by handle (O(new tokens))
    router.remove_worker(u) -> [rid, ...]    a worker died: its in-flight requests, to retry
    router.add_worker(u)                     a worker (re)joined

State: the global tree (which worker holds which prefix), each worker's queue length as the
router sees it (dispatched − finished) and the requests in flight. Messages arrive late and
may be stale — a ``Finished`` for a request whose worker was removed, an ``Evicted`` for a
path the tree never had — and are then ignored (and counted in ``stats``), never an error.

Ordering (assuming each worker's messages arrive in the order it sent them): once an
``Evicted`` block ``(path, start)`` from worker u is handled, the tree no longer credits u
with any token of ``path`` at or past ``start`` until a later dispatch to u (or a later
``Finished`` from u) puts it back. A ``Finished`` stamped before the latest eviction report
from its worker does not re-insert its tokens: they may be among those evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_fair.kv_decoder import Cleared, KVEventDecoder, Removed, Stored, TreeOp
from sgl_fair.kv_events import EventBatch
from sgl_fair.kv_follow import OwnerFollower
from sgl_fair.messages import Dispatch, Evicted, Finished, Load, Tokens
from sgl_fair.policies.base import Rejection
from sgl_fair.radix_node import Node
from sgl_fair.radix_node import Tokens as KVTokens
from sgl_fair.request import ClientId, Request
from sgl_fair.router.global_tree import GlobalTree
from sgl_fair.router.oit import ClusterOIT
from sgl_fair.router.policies.base import RouterPolicy


@dataclass
class WorkerStats:
    """What the router did with / heard from one worker (counters only)."""

    num_dispatched: int = 0
    num_finished: int = 0  # Finished messages handled, ok or not
    num_failed: int = 0  # … of which rejected or aborted
    num_evicted_blocks: int = 0
    num_evicted_tokens: int = 0  # tokens the tree pruned because of eviction reports
    num_output_tokens: int = 0  # from Tokens messages
    num_stale: int = 0  # messages ignored: unknown request, or from a dead worker
    num_kv_events: int = 0  # KV-event tree ops applied (Stored / Removed / Cleared)


class Router:
    """Implements ``RouterView`` for its policy (``now``, ``workers``, ``queue_len``, ``tree``)."""

    # The ``(replica, charge)`` tag of the dispatch just made, for the transport to send
    # with it and clear: a single router tags nothing (router replicas do: router/replica.py).
    last_tag: tuple[int, int] | None = None

    def __init__(
        self,
        policy: RouterPolicy,
        num_workers: int,
        *,
        insert_outputs: bool = True,
        max_tree_tokens: int | None = None,
        oit: ClusterOIT | None = None,
        queues_from_loads: bool = False,
    ) -> None:
        """``oit``: FairServe's throttling over the cluster (``router/oit.py``), checked by
        ``throttle`` before a request is dispatched; None: nothing is throttled.
        ``queues_from_loads``: other routers dispatch to these workers too and share no
        service reports with this one (independent replicas; replicas over SGLang servers):
        a worker's queue is at least what its latest ``Load`` counts, waiting and running,
        every router's requests together."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (got {num_workers})")
        if max_tree_tokens is not None and max_tree_tokens < 0:
            raise ValueError(f"max_tree_tokens must be >= 0 (got {max_tree_tokens})")
        self.policy = policy
        self.tree = GlobalTree()
        self.insert_outputs = insert_outputs
        self.max_tree_tokens = max_tree_tokens
        self.oit = oit
        self.queues_from_loads = queues_from_loads
        self.now = 0.0
        self.inflight: dict[str, tuple[int, ClientId]] = {}  # rid -> (worker, client)
        self.client_inflight: dict[ClientId, int] = {}  # client -> its calls in self.inflight
        self.stats: dict[int, WorkerStats] = {u: WorkerStats() for u in range(num_workers)}
        self._queue_len: dict[int, int] = dict.fromkeys(range(num_workers), 0)
        self._workers: tuple[int, ...] = tuple(range(num_workers))
        self._loads: dict[int, Load] = {}
        self._load_seen: dict[int, float] = {}  # when (router clock) the latest Load came
        self._evicted_s: dict[int, float] = {}  # latest Evicted.t_s per worker
        self._followers: dict[int, _WorkerFollower] = {}  # follow_kv's, per worker
        self._draining: set[int] = set()  # alive, finishing their requests, chosen for none

    # ---- RouterView ------------------------------------------------------------------------

    @property
    def workers(self) -> tuple[int, ...]:
        """Alive worker ids, ascending."""
        return self._workers

    def queue_len(self, worker: int) -> int:
        own = self._queue_len.get(worker, 0)
        if not self.queues_from_loads:
            return own
        load = self._loads.get(worker)
        return own if load is None else max(own, load.num_waiting + load.num_running)

    def load(self, worker: int) -> Load | None:
        """The most recent ``Load`` report from ``worker`` (by its timestamp), if any."""
        return self._loads.get(worker)

    def load_seen_s(self, worker: int) -> float | None:
        """When (the router's ``now``) it took ``worker``'s latest ``Load``, if any."""
        return self._load_seen.get(worker)

    # ---- throttling (the cluster OIT) ----------------------------------------------------------

    def throttle(self, req: Request, now: float) -> Rejection | None:
        """Whether the cluster OIT throttles ``req``: its Rejection, or None to dispatch it. Call it
        once per request that arrives (a re-dispatch after a worker died is no arrival)."""
        if self.oit is None:
            return None
        self.now = now
        return self.oit.on_arrival(req, now, self, self.inflight)

    # ---- dispatch --------------------------------------------------------------------------

    def take_tag(self, rid: str) -> tuple[int, int, int] | None:
        """The ``(replica, seq, charge)`` tag of ``rid``'s dispatch: None, a single router
        tags nothing (router replicas do: ``router/replica.py``)."""
        return None

    def dispatch(self, req: Request, now: float) -> Dispatch:
        """Choose a worker for ``req`` and record it; raises RuntimeError if none is alive."""
        if not self._workers:
            raise RuntimeError(f"no worker alive to take request {req.rid!r}")
        if req.rid in self.inflight:
            raise ValueError(f"request {req.rid!r} is already in flight")
        self.now = now
        match = self.tree.match(req.input_ids)
        worker = self.policy.select(req, match, self)
        if worker not in self._queue_len:
            raise RuntimeError(f"policy {self.policy.name!r} chose dead worker {worker}")
        self.tree.insert(req.input_ids, worker)
        self.policy.on_dispatched(req, worker, match, self)
        self._queue_len[worker] += 1
        self.inflight[req.rid] = (worker, req.client)
        n = self.client_inflight.get(req.client, 0) + 1
        self.client_inflight[req.client] = n
        req.cluster_inflight = n  # the worker's share guard compares clients by it
        self.stats[worker].num_dispatched += 1
        self._bound_tree()
        return Dispatch(worker, req, now)

    # ---- worker messages -------------------------------------------------------------------

    def handle(self, msg: Tokens | Finished | Evicted | Load, now: float) -> None:
        self.now = now
        if isinstance(msg, Finished):
            self._finished(msg)
        elif isinstance(msg, Evicted):
            self._evicted(msg)
        elif isinstance(msg, Tokens):
            self._stats(msg.worker).num_output_tokens += sum(len(ids) for _, ids in msg.items)
        elif isinstance(msg, Load):
            latest = self._loads.get(msg.worker)
            if latest is None or msg.t_s >= latest.t_s:
                self._loads[msg.worker] = msg
                self._load_seen[msg.worker] = now
        else:
            raise TypeError(f"not a worker message: {msg!r}")

    def _finished(self, msg: Finished) -> None:
        stats = self._stats(msg.worker)
        entry = self.inflight.get(msg.rid)
        if entry is None or entry[0] != msg.worker or msg.worker not in self._queue_len:
            stats.num_stale += 1  # its worker was removed (the rid was re-dispatched)
            return
        del self.inflight[msg.rid]
        self._left(entry[1])
        self._queue_len[msg.worker] -= 1
        stats.num_finished += 1
        if not msg.ok:
            stats.num_failed += 1
        if self.oit is not None:
            self.oit.on_finished(msg.rid, self.now)
        self.policy.on_finished(msg, self)
        if (
            self.insert_outputs
            and msg.ok
            and msg.t_s >= self._evicted_s.get(msg.worker, float("-inf"))
        ):
            # The worker caches what it computed; a follow-up call's prompt is this
            # prompt plus this output.
            self.tree.insert(msg.input_ids + msg.output_ids, msg.worker)
            self._bound_tree()

    def _evicted(self, msg: Evicted) -> None:
        stats = self._stats(msg.worker)
        if msg.worker not in self._queue_len:
            stats.num_stale += 1  # a dead worker holds nothing in the tree already
            return
        self._mark_evicted(msg.worker, msg.t_s)
        stats.num_evicted_blocks += len(msg.blocks)
        for path, start in msg.blocks:
            stats.num_evicted_tokens += self.tree.evicted(msg.worker, path, start)

    def apply_kv_ops(self, worker: int, ops: Sequence[TreeOp], t_s: float) -> None:
        """Follow ``worker``'s cache through its KV events (``KVEventDecoder.apply``'s ops).

        The authoritative alternative to guessing from dispatches and ``Finished``: a
        ``Stored`` path is held, a ``Removed`` block is handled exactly like an ``Evicted``
        one (so a ``Finished`` stamped before ``t_s``, the batch's time on the worker's
        clock, does not re-insert), and ``Cleared`` forgets everything the worker held
        while it stays alive. Ops from a dead worker are ignored (one ``num_stale``).
        """
        stats = self._stats(worker)
        if worker not in self._queue_len:
            if ops:
                stats.num_stale += 1
            return
        tree = self.tree
        stored = False
        for op in ops:
            stats.num_kv_events += 1
            if isinstance(op, Stored):
                tree.insert(op.path, worker)
                stored = True
            elif isinstance(op, Removed):
                self._mark_evicted(worker, t_s)
                stats.num_evicted_blocks += 1
                stats.num_evicted_tokens += tree.evicted(worker, op.path, op.start)
            elif isinstance(op, Cleared):
                self._mark_evicted(worker, t_s)
                stats.num_evicted_tokens += tree.remove_worker(worker)
            else:
                raise TypeError(f"not a KV tree op: {op!r}")
        if stored:
            self._bound_tree()

    def follow_kv(
        self, worker: int, decoder: KVEventDecoder, batch: EventBatch, t_s: float
    ) -> None:
        """``apply_kv_ops(worker, decoder.apply(batch), t_s)``, each op applied as the
        decoder reads it, by the tree node of an earlier op through the same point
        (``sgl_fair.kv_follow``): O(the event's tokens), not O(its prefix depth)."""
        follower = self._followers.get(worker)
        if follower is None or follower.tree is not self.tree.tree:
            follower = self._followers[worker] = _WorkerFollower(self, worker)
            decoder.drop_handles()  # a new follower: no node the decoder holds is its own
        if worker not in self._queue_len:
            ignore = _Ignore()
            decoder.follow(batch, ignore)
            if ignore.num_ops:
                self._stats(worker).num_stale += 1
            return
        follower.t_s = t_s
        before = follower.num_ops
        decoder.follow(batch, follower)
        self._stats(worker).num_kv_events += follower.num_ops - before
        if follower.any_stored:
            follower.any_stored = False
            self._bound_tree()

    def _mark_evicted(self, worker: int, t_s: float) -> None:
        if t_s > self._evicted_s.get(worker, float("-inf")):
            self._evicted_s[worker] = t_s

    def _bound_tree(self) -> None:
        limit = self.max_tree_tokens
        if limit is not None and self.tree.total_tokens > limit:
            # Trim 1/256 below the limit: one trim per many inserts rather than a leaf or
            # two on every dispatch (same work in total, off most decisions' path).
            self.tree.trim(limit - limit // 256)

    def _stats(self, worker: int) -> WorkerStats:
        stats = self.stats.get(worker)
        if stats is None:
            stats = self.stats[worker] = WorkerStats()
        return stats

    # ---- membership ------------------------------------------------------------------------

    def remove_worker(self, worker: int) -> list[str]:
        """Mark ``worker`` dead and forget what it held; returns its in-flight rids.

        The caller decides what to do with them (re-dispatch, or fail them to the client).
        Removing a worker that is not alive returns ``[]``.
        """
        if worker not in self._queue_len:
            return []
        del self._queue_len[worker]
        self._draining.discard(worker)
        self._workers = self._choosable()
        self._loads.pop(worker, None)
        self._load_seen.pop(worker, None)
        self._evicted_s.pop(worker, None)
        self.tree.remove_worker(worker)
        self.policy.on_worker_removed(worker)
        lost = [rid for rid, (u, _) in self.inflight.items() if u == worker]
        for rid in lost:
            self._left(self.inflight.pop(rid)[1])
        return lost

    def _left(self, client: ClientId) -> None:
        """One of ``client``'s calls is no longer in flight."""
        n = self.client_inflight.get(client, 0) - 1
        if n > 0:
            self.client_inflight[client] = n
        else:
            self.client_inflight.pop(client, None)

    def add_worker(self, worker: int) -> None:
        """(Re)join ``worker`` with an empty queue; a no-op if it is alive already."""
        if worker < 0:
            raise ValueError(f"worker ids are >= 0 (got {worker})")
        if worker in self._queue_len:
            return
        self._queue_len[worker] = 0
        self._workers = self._choosable()
        self._stats(worker)

    def drain_worker(self, worker: int, draining: bool = True) -> None:
        """Choose ``worker`` for no new request (``draining=False``: again) while what it
        has runs on and is accounted as before (a rolling restart's drain)."""
        if worker not in self._queue_len:
            raise ValueError(f"worker {worker} is not alive")
        if draining:
            self._draining.add(worker)
        else:
            self._draining.discard(worker)
        self._workers = self._choosable()

    @property
    def draining(self) -> frozenset[int]:
        return frozenset(self._draining)

    def _choosable(self) -> tuple[int, ...]:
        return tuple(sorted(u for u in self._queue_len if u not in self._draining))

    # ---- invariants ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        alive = set(self._queue_len)
        assert self._workers == tuple(sorted(alive - self._draining)), "workers tuple out of date"
        dead_held = self.tree.workers() - alive
        assert not dead_held, f"dead workers {sorted(dead_held)} still hold prefixes"
        counts = dict.fromkeys(alive, 0)
        for rid, (u, _) in self.inflight.items():
            assert u in alive, f"request {rid!r} in flight on dead worker {u}"
            counts[u] += 1
        assert counts == self._queue_len, f"queue_len {self._queue_len} != in flight {counts}"
        per_client: dict[ClientId, int] = {}
        for _, c in self.inflight.values():
            per_client[c] = per_client.get(c, 0) + 1
        assert per_client == self.client_inflight, "client_inflight out of date"
        if self.max_tree_tokens is not None:
            assert self.tree.total_tokens <= self.max_tree_tokens, "tree above max_tree_tokens"


class _WorkerFollower(OwnerFollower):
    """One worker's KV events into the router's tree, with the router's counts."""

    def __init__(self, router: Router, worker: int) -> None:
        super().__init__(router.tree.tree, worker)
        self._router = router
        self._worker = worker
        self.t_s = 0.0
        self.any_stored = False

    def stored(
        self, base: object | None, up: int, tokens: KVTokens, path: Callable[[], KVTokens]
    ) -> Node:
        self.any_stored = True
        return super().stored(base, up, tokens, path)

    def removed(
        self, base: object | None, up: int, path: Callable[[], tuple[KVTokens, int]]
    ) -> None:
        self._router._mark_evicted(self._worker, self.t_s)
        stats = self._router._stats(self._worker)
        before = self.removed_tokens
        super().removed(base, up, path)
        stats.num_evicted_blocks += 1
        stats.num_evicted_tokens += self.removed_tokens - before

    def cleared(self) -> None:
        self._router._mark_evicted(self._worker, self.t_s)
        before = self.removed_tokens
        super().cleared()
        self._router._stats(self._worker).num_evicted_tokens += self.removed_tokens - before


class _Ignore:
    """A dead worker's events: the decoder follows them (its pages stay right), nothing else."""

    def __init__(self) -> None:
        self.num_ops = 0

    def stored(self, base: object, up: int, tokens: KVTokens, path: object) -> None:
        self.num_ops += 1

    def removed(self, base: object, up: int, path: object) -> None:
        self.num_ops += 1

    def cleared(self) -> None:
        self.num_ops += 1
