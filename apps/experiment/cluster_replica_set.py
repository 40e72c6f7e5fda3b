"""R router replicas behind a load balancer, as the cluster simulator drives one router.

``ReplicaSet`` is the simulator's model of a replicated router (``docs/replicas.md``):

* **Load balancer**: round robin over the replicas, call by call (a load balancer's default),
  so every replica sees every client; a call stays with its replica until it finishes.
* **Messages**: ``Tokens`` and ``Finished`` go back to the replica that dispatched the call;
  ``Load`` (with the workers' ``ServiceReport``) and ``Evicted`` go to every replica.
* **Global trees** (``shared=True``): each replica follows the workers' KV events, so another
  replica's dispatch of a prompt to worker u reaches its tree when u publishes it — modelled
  as when u receives the dispatch, one network delay later (``kv_event_delay_s`` after the
  dispatch, by default two delays; SGLang publishes ``BlockStored`` at prefill, which is later
  by the queue wait: this is the optimistic side, as the dispatching replica's own insert at
  dispatch is); a finished call's output reaches every tree with its ``Finished``.
* ``shared=False``: independent replicas (today's router behind a load balancer): each keeps
  its own dispatches, its own tree and its own ``Finished``; workers' ``Load`` and
  ``Evicted`` reach all of them.

It also measures what the replicas' staleness does to D2LPM's state, in service units
(``w_e`` × extend + ``w_o`` × output, the policy's weights): at each dispatch, ``lag`` = how
much of the client's service on some worker the dispatching replica had not yet seen, and
``spread`` = how far the client's service on its most-charged worker runs ahead of its
least-charged one (the quantity D2LPM's bound is about; ``stats()``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from sgl_fair.kv_decoder import Stored
from sgl_fair.messages import Dispatch, Evicted, Finished, Load, Tokens
from sgl_fair.policies.base import Rejection
from sgl_fair.request import Request
from sgl_fair.router.policies.base import PeerServiceAware, RouterPolicy
from sgl_fair.router.replica import ReplicaRouter


class ReplicaSet:
    def __init__(
        self,
        make_policy: Callable[[], RouterPolicy],
        num_workers: int,
        replicas: int,
        *,
        shared: bool,
        kv_event_delay_s: float = 0.001,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1 (got {replicas})")
        if kv_event_delay_s < 0:
            raise ValueError(f"kv_event_delay_s must be >= 0 (got {kv_event_delay_s})")
        self.replicas = [
            ReplicaRouter(make_policy(), num_workers, replica=i, shared=shared)
            for i in range(replicas)
        ]
        self.shared = shared
        self.kv_event_delay_s = kv_event_delay_s
        self._next = 0
        self._owner: dict[str, int] = {}  # rid -> replica, while in flight
        self._tags: dict[str, tuple[int, int]] = {}
        self._feed: deque[tuple[float, int, int, tuple[int, ...]]] = deque()  # due, r, u, path
        policy = self.replicas[0].policy  # the service units the lag is measured in
        weights = policy.service_weights() if isinstance(policy, PeerServiceAware) else (1.0, 2.0)
        self._w_e, self._w_o = (float(w) for w in weights)
        # per replica: (worker, client) -> [extend, output] tokens it charged itself
        self._own: list[dict[tuple[int, str], list[int]]] = [{} for _ in self.replicas]
        self._truth: dict[tuple[int, str], float] = {}  # all replicas' charges, service units
        self.lag_max = 0.0
        self.lag_sum = 0.0
        self.spread_max = 0.0
        self.num_dispatches = 0

    # ---- what the simulator calls -----------------------------------------------------------

    def throttle(self, req: Request, now: float) -> Rejection | None:
        self._deliver(now)
        r = self._pick(req)
        rejection = self.replicas[r].throttle(req, now)
        if rejection is not None:
            del self._owner[req.rid]
        return rejection

    def dispatch(self, req: Request, now: float) -> Dispatch:
        self._deliver(now)
        r = self._pick(req)
        rep = self.replicas[r]
        self._measure_lag(r, req.client)
        match = None if self.shared else rep.tree.match(req.input_ids, touch=False)
        dispatch = rep.dispatch(req, now)
        u = dispatch.worker
        if match is None:  # the charge the replica tagged the dispatch with
            assert rep.last_tag is not None
            extend = rep.last_tag[1]
        else:
            extend = req.input_len - match.per_worker.get(u, 0)
        self._account(r, u, req.client, extend, 0)
        self._measure_spread(req.client)
        if self.shared:
            if rep.last_tag is not None:
                self._tags[req.rid] = rep.last_tag
            if len(self.replicas) > 1:
                due = now + self.kv_event_delay_s
                self._feed.append((due, r, u, req.input_ids))
        return dispatch

    def take_tag(self, rid: str) -> tuple[int, int] | None:
        return self._tags.pop(rid, None)

    def handle(self, msg: Tokens | Finished | Evicted | Load, now: float) -> None:
        self._deliver(now)
        if isinstance(msg, Finished):
            r = self._owner.pop(msg.rid, None)
            if r is None:
                return
            rep = self.replicas[r]
            entry = rep.inflight.get(msg.rid)
            own = entry is not None and entry[0] == msg.worker and msg.worker in rep.workers
            rep.handle(msg, now)
            if own:
                self._account(r, msg.worker, msg.client, 0, msg.num_output)
            if self.shared and msg.ok:
                path = msg.input_ids + msg.output_ids
                for i, peer in enumerate(self.replicas):
                    if i != r and msg.worker in peer.workers:
                        peer.apply_kv_ops(msg.worker, [Stored(path)], msg.t_s)
        elif isinstance(msg, Tokens):
            by_replica: dict[int, list] = {}
            for item in msg.items:
                r = self._owner.get(item[0])
                if r is not None:
                    by_replica.setdefault(r, []).append(item)
            for r, items in sorted(by_replica.items()):
                self.replicas[r].handle(Tokens(msg.worker, msg.t_s, tuple(items)), now)
        else:
            for rep in self.replicas:
                rep.handle(msg, now)

    def check_invariants(self) -> None:
        for r, rep in enumerate(self.replicas):
            rep.check_invariants()
            if not self.shared:
                continue
            for (u, c), total in self._truth.items():
                ext, out = rep.state.service(u, c)
                seen = self._w_e * ext + self._w_o * out
                assert seen <= total + 1e-6, f"replica {r} sees {seen} > {total} for {(u, c)}"
                own = self._own[r].get((u, c), (0, 0))
                assert ext >= own[0] and out >= own[1], f"replica {r} lost its own {(u, c)}"

    # ---- statistics -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        n = self.num_dispatches
        return {
            "view_lag_max": round(self.lag_max, 1),
            "view_lag_mean": round(self.lag_sum / n, 1) if n else 0.0,
            "spread_max": round(self.spread_max, 1),
            "num_reports": sum(rep.state.num_reports for rep in self.replicas),
            "replica_dispatches": [
                sum(s.num_dispatched for s in rep.stats.values()) for rep in self.replicas
            ],
        }

    # ---- internals --------------------------------------------------------------------------

    def _pick(self, req: Request) -> int:
        r = self._owner.get(req.rid)
        if r is None:
            r = self._next
            self._next = (r + 1) % len(self.replicas)
            self._owner[req.rid] = r
        return r

    def _deliver(self, now: float) -> None:
        """Apply the KV events (other replicas' dispatches) published by ``now``."""
        feed = self._feed
        while feed and feed[0][0] <= now:
            due, r, u, path = feed.popleft()
            for i, peer in enumerate(self.replicas):
                if i != r and u in peer.workers:
                    peer.apply_kv_ops(u, [Stored(path)], due)

    def _account(self, r: int, u: int, client: str, extend: int, output: int) -> None:
        own = self._own[r].setdefault((u, client), [0, 0])
        own[0] += extend
        own[1] += output
        key = (u, client)
        self._truth[key] = self._truth.get(key, 0.0) + self._w_e * extend + self._w_o * output

    def _seen(self, r: int, u: int, client: str) -> float:
        if self.shared:
            ext, out = self.replicas[r].state.service(u, client)
        else:
            ext, out = self._own[r].get((u, client), (0, 0))
        return self._w_e * ext + self._w_o * out

    def _measure_lag(self, r: int, client: str) -> None:
        workers = self.replicas[r].workers
        lag = max(self._truth.get((u, client), 0.0) - self._seen(r, u, client) for u in workers)
        self.lag_max = max(self.lag_max, lag)
        self.lag_sum += lag
        self.num_dispatches += 1

    def _measure_spread(self, client: str) -> None:
        values = [self._truth.get((u, client), 0.0) for u in self.replicas[0].workers]
        self.spread_max = max(self.spread_max, max(values) - min(values))
