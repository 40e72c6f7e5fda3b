"""D2LPM — Double Deficit LPM, the global router (DLPM paper §5.2, Alg. 2; SPEC §3).

Locality first, until a per-(worker, client) deficit says a client has had its share of a
worker. State: ``D[u][c]`` (starts at 0) and a quantum ``Q_u`` per worker.

* Dispatch of r from c: ``W`` = workers holding r's longest matched prefix (all alive
  workers if nothing matched). If every alive worker has ``D[u][c] <= 0``, replenish
  ``D[u][c] += Q_u`` on all of them. Pick the least-queued worker in ``W`` with
  ``D[u][c] > 0``; if there is none, the least-queued worker anywhere with ``D[u][c] > 0``
  (ties: lowest id). Charge ``D[u][c] -= w_e * (input_len - matched_len_on_u)``.
* Completion (ok or not, the tokens actually produced): ``D[u][c] -= w_o * num_output``.

Replenishing adds as many rounds as it takes for some worker to turn positive: when one
request costs more than a quantum, a single round may leave every deficit <= 0, and
``k`` rounds at once equal ``k`` consecutive replenishments that each found no candidate
(DLPM's walk does the same).

``Q_u = inf`` makes the deficits never bind: pure locality-first dispatch (least-queued
among holders), which is not fair (Thm A.5). A dead worker's deficits are forgotten; a
worker that (re)joins starts at 0.

**Load guard** *(beyond the paper)*. The deficit binds only as service is charged, and a
hot prefix costs almost nothing to extend while its outputs are charged only when requests
finish: one tenant's 3,000 requests on one cached prefix all went to the worker holding it,
2,824 of them waiting there, while three workers sat idle. So locality is taken only from a
holder whose queue is at most ``max_queue_ratio`` × the *least-queued* alive worker's queue
plus ``queue_slack``; past it the request goes to the least-queued eligible worker (which
then holds the prefix too, so locality spreads instead of piling up). Measured against the
least-queued worker, not the mean: against the mean, two holders could split a burst while
two workers stayed idle (each at exactly 2× the mean: live, 1,377 and 1,376 queued beside 0
and 0). ``max_queue_ratio = inf`` is the paper's exact rule.

**Sliding deficits** *(beyond the paper; ``deficits="sliding"``)*. The paper replenishes a
client only when its deficit is spent on *every* worker, so late in a round a client has one
or two eligible workers left and its calls go there whatever they hold. The sliding rule keeps
the quantity the paper's bound is about — how far a client's charged service on one worker
runs ahead of its least-charged worker, at most ``Q_u`` plus one request and the outputs in
flight — but measures it continuously: before each dispatch, the client's deficits are shifted
(each by the same number of its own quanta) so that its least-charged worker holds exactly
``Q_u``. A worker is eligible while ``S[u] / Q_u < min_v S[v] / Q_v + 1``; a (re)joining
worker starts level with the least-charged one. Same spread bound (tested), never a round
with few eligible workers.

**Load in outstanding tokens** *(beyond the paper; ``load="tokens"``)*. "Least queued"
counts requests; a 16-call fan-out of 2,000-token prompts then looks like 16 chats. With
``load="tokens"`` the least-loaded choice and the load guard use each worker's outstanding
work in the deficits' units (``router/policies/outstanding.py``): ``w_e`` × uncached input
+ ``w_o`` × the client's mean output so far, from dispatch until the request finishes; the
guard's slack is ``queue_slack`` mean-priced requests.

**Defaults** *(beyond the paper)*: sliding deficits and ``Q_u`` = 300,000 service units —
about 20 s of one worker's service per client — so the router's deficits bind over long
horizons and leave per-worker fairness to the workers' DLPM. Measured over the whole
``d2lpm-grid`` (BENCHMARKS.md, session 7), against the paper's rounds with ``Q_u`` = 10,000:
per-worker deficits of 10,000 moved a client's follow-up calls off the worker holding their
prefix (611 of 3,330 dispatches in a ToT-S2 cell), losing locality (hit rate 0.82 vs 0.95)
with no fairness gained. ``deficits="rounds", quantum=10_000`` is the paper's setting.

**Bounded state** *(beyond the paper)*. A client's deficits are kept for the
``max_clients`` (10,000) most recently active clients (dispatch or finish); past that the
one idle longest is forgotten and, should it come back, starts as a new client (one quantum
on every worker: at most one quantum per worker ahead of where it stood). Client ids come
from a header without API keys, so without a bound anyone could grow this table. Exact
forgetting cannot hold here: a client's deficits differ between workers after its first
dispatch, and that difference is what keeps its next call off the worker it used.

Options (``make_router_policy("d2lpm", ...)``): ``quantum`` (300,000.0, service units; may be
``float('inf')``), ``quanta`` (per-worker overrides of ``quantum``, ``{}``),
``extend_weight`` (``w_e``, 1.0), ``output_weight`` (``w_o``, 2.0), ``max_queue_ratio``
(2.0; ``inf``: off), ``queue_slack`` (8 requests), ``deficits`` (``"sliding"``;
``"rounds"``: the paper's), ``load`` (``"requests"``: the paper's; ``"tokens"``),
``default_output_len`` (128.0: the expected output of a client with none finished yet, for
``load="tokens"``), ``max_clients`` (10,000: clients whose deficits are kept).

**Router replicas** *(beyond the paper)*. ``on_peer_service`` charges the service other
replicas dispatched, as the workers report it (``router/replica.py``, ``docs/replicas.md``);
with ``load="tokens"`` the outstanding work stays this replica's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sgl_fair.messages import Finished
from sgl_fair.request import ClientId, Request
from sgl_fair.router.global_tree import GlobalMatch
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    check_positive,
    register_router_policy,
)
from sgl_fair.router.policies.outstanding import OutstandingWork

LOADS = ("requests", "tokens")
DEFICIT_RULES = ("rounds", "sliding")


@register_router_policy("d2lpm")
class D2LPM(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        quantum: float = 300_000.0
        quanta: Mapping[int, float] = field(default_factory=dict)
        extend_weight: float = 1.0
        output_weight: float = 2.0
        max_queue_ratio: float = 2.0
        queue_slack: float = 8.0
        load: str = "requests"
        deficits: str = "sliding"
        default_output_len: float = 128.0
        max_clients: int = 10_000

        def __post_init__(self) -> None:
            check_positive("d2lpm", quantum=self.quantum)
            if not self.max_queue_ratio >= 1:
                raise ValueError(
                    f"d2lpm: max_queue_ratio must be >= 1 (got {self.max_queue_ratio})"
                )
            if not (self.queue_slack >= 0 and math.isfinite(self.queue_slack)):
                raise ValueError(
                    f"d2lpm: queue_slack must be finite and >= 0 (got {self.queue_slack})"
                )
            if self.deficits not in DEFICIT_RULES:
                raise ValueError(
                    f"d2lpm: deficits must be one of {DEFICIT_RULES} (got {self.deficits!r})"
                )
            if self.load not in LOADS:
                raise ValueError(f"d2lpm: load must be one of {LOADS} (got {self.load!r})")
            if not (self.default_output_len > 0 and math.isfinite(self.default_output_len)):
                raise ValueError(
                    "d2lpm: default_output_len must be finite and > 0 "
                    f"(got {self.default_output_len})"
                )
            if not (isinstance(self.max_clients, int) and self.max_clients >= 1):
                raise ValueError(f"d2lpm: max_clients must be an integer >= 1 "
                                 f"(got {self.max_clients!r})")  # fmt: skip
            for worker, q in self.quanta.items():
                check_positive("d2lpm", **{f"quanta[{worker}]": q})
            for key in ("extend_weight", "output_weight"):
                value = getattr(self, key)
                if not (value >= 0 and math.isfinite(value)):
                    raise ValueError(f"d2lpm: {key} must be finite and >= 0 (got {value})")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        # client -> worker -> D, least recently used first (``max_clients``)
        self._deficits: dict[ClientId, dict[int, float]] = {}
        self.num_forgotten = 0
        self._unbounded = {u for u, q in self.config.quanta.items() if q == math.inf}
        self._bounded = {u for u, q in self.config.quanta.items() if q != math.inf}
        self._work: OutstandingWork | None = None
        if self.config.load == "tokens":
            self._work = OutstandingWork(
                extend_weight=self.config.extend_weight,
                output_weight=self.config.output_weight,
                default_output_len=self.config.default_output_len,
                max_clients=self.config.max_clients,
            )

    def quantum_of(self, worker: int) -> float:
        return self.config.quanta.get(worker, self.config.quantum)

    def deficit(self, worker: int, client: ClientId) -> float:
        return self._deficits.get(client, {}).get(worker, 0.0)

    def _eligible(self, workers: Sequence[int], client: ClientId) -> list[int]:
        """Workers where ``client`` has deficit left (an infinite quantum never runs out)."""
        d = self._deficits.get(client, {})
        if self.config.quantum == math.inf:
            bounded = self._bounded
            return [u for u in workers if u not in bounded or d.get(u, 0.0) > 0]
        unbounded = self._unbounded
        return [u for u in workers if d.get(u, 0.0) > 0 or u in unbounded]

    def _touch(self, client: ClientId) -> dict[int, float]:
        """``client``'s deficits, now the most recently used (least recently used forgotten
        past ``max_clients``)."""
        table = self._deficits
        d = table.pop(client, None)
        if d is None:
            d = {}
            if len(table) >= self.config.max_clients:
                del table[next(iter(table))]
                self.num_forgotten += 1
        table[client] = d
        return d

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        workers = view.workers
        client = req.client
        self._touch(client)
        if self.config.deficits == "sliding":
            self._slide(workers, client)
        eligible = self._eligible(workers, client)
        if not eligible:
            self._replenish(workers, client)
            eligible = self._eligible(workers, client)
        if match.length:
            holders = match.holders
            load = self._load_of(view)
            limit = self._locality_limit(load, workers)
            local = [u for u in eligible if u in holders and load(u) <= limit]
            if local:
                return min(local, key=load)  # ties: the first, i.e. the lowest id
        return min(eligible, key=self._load_of(view))

    def _load_of(self, view: RouterView) -> Callable[[int], float]:
        """A worker's load: queued requests, or outstanding tokens with ``load="tokens"``."""
        return view.queue_len if self._work is None else self._work.of

    def _locality_limit(self, load: Callable[[int], float], workers: Sequence[int]) -> float:
        """The load past which a holder is too busy to be given a request for locality's
        sake: ``max_queue_ratio`` × the least-loaded alive worker's load plus ``queue_slack``
        (requests; with ``load="tokens"``, that many mean-priced requests)."""
        ratio = self.config.max_queue_ratio
        if ratio == math.inf:
            return math.inf
        slack = self.config.queue_slack
        if self._work is not None:
            slack *= self._work.mean_price
        return ratio * min(load(u) for u in workers) + slack

    def _replenish(self, workers: Sequence[int], client: ClientId) -> None:
        # Every D[u][c] <= 0 and every Q_u finite here; the fewest rounds that make some
        # deficit positive.
        d = self._deficits.setdefault(client, {})
        rounds = min(math.floor(-d.get(u, 0.0) / self.quantum_of(u)) + 1 for u in workers)
        for u in workers:
            d[u] = d.get(u, 0.0) + rounds * self.quantum_of(u)

    def _slide(self, workers: Sequence[int], client: ClientId) -> None:
        """The sliding rule: shift the client's deficits (each by the same number of its own
        quanta) so that its least-charged worker holds exactly one quantum. A worker the
        client has no deficit on yet (new client, (re)joined worker) starts level with that
        least-charged one."""
        d = self._deficits.setdefault(client, {})
        bounded = [u for u in workers if self.quantum_of(u) != math.inf]
        if not bounded:
            return
        levels = [d[u] / self.quantum_of(u) for u in bounded if u in d]
        top = max(levels) if levels else 1.0
        shift = 1.0 - top
        for u in bounded:
            q = self.quantum_of(u)
            d[u] = (d[u] if u in d else top * q) + shift * q

    def _charge(self, worker: int, client: ClientId, service: float) -> None:
        d = self._touch(client)
        d[worker] = d.get(worker, 0.0) - service

    def on_dispatched(
        self, req: Request, worker: int, match: GlobalMatch, view: RouterView
    ) -> None:
        extend_len = req.input_len - match.per_worker.get(worker, 0)
        self._charge(worker, req.client, self.config.extend_weight * extend_len)
        if self._work is not None:
            self._work.dispatched(req, worker, extend_len)

    def on_finished(self, msg: Finished, view: RouterView) -> None:
        if msg.worker in view.workers:
            self._charge(msg.worker, msg.client, self.config.output_weight * msg.num_output)
        if self._work is not None:
            self._work.finished(msg)

    def service_weights(self) -> tuple[float, float]:
        return self.config.extend_weight, self.config.output_weight

    def on_peer_service(
        self, worker: int, client: ClientId, extend: int, output: int, view: RouterView
    ) -> None:
        """Other router replicas' service to ``client`` on ``worker`` (extend and output
        tokens), from the worker's report (``router/replica.py``): charged as if dispatched
        here, so every replica's deficits follow the service all replicas dispatched."""
        if worker in view.workers:
            cfg = self.config
            if client not in self._deficits:  # new here: D starts at 0 on every worker, so
                # the sliding rule does not start the others level with this charged one
                self._touch(client).update(dict.fromkeys(view.workers, 0.0))
            self._charge(worker, client, cfg.extend_weight * extend + cfg.output_weight * output)

    def on_worker_removed(self, worker: int) -> None:
        for d in self._deficits.values():
            d.pop(worker, None)
        if self._work is not None:
            self._work.worker_removed(worker)
