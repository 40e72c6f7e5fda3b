"""FairServe — WSC + OIT (FairServe paper, Alg. 1; SPEC §4).

**WSC** (weighted service counter): a counter ``u_i`` per *user* (the request's ``client``)
with VTC's lift. A call of stage ``j`` of app ``a`` costs

    E_i · (α·L_I + β·L_S + γ·L_O) / w(a, j)        α=1, β=2, γ=1 by default

``L_S`` the request's system-prompt tokens (``Request.system_len``: over HTTP, a chat's
system messages or a declared ``system_len``; else the app's ``system_lens[app]``; capped at
the input), ``L_I``
the rest of the input, ``L_O`` the output, ``E_i`` the user's priority factor (``priority``;
larger = *less* service). ``w(a, j)`` is the expected ``α·L_I + β·L_S + γ·L_O`` of that app
stage: a running mean over finished calls *(learned online: beyond the paper)*, seeded from
``stage_weights`` (``"app"`` or ``"app/stage"`` keys, worth ``seed_count`` observations); an
unseeded stage's first call costs exactly 1. A typical call of any app stage so costs about
``E_i``: apps whose calls are long by design are not penalised for it.

Charging (``charge``):

* ``"admission"`` (default, *beyond the paper*): at admission charge the input part plus the
  stage's expected output ``N̄_O``; at finish settle to the true output (a refund when it was
  shorter). Like VTC's length prediction, this stops one least-served user from taking every
  free slot in one admission walk before anything is charged.
* ``"finish"``: the paper's rule (Alg. 1 l.43-48): the whole cost once, at finish.

Counters never carry credit: a user (re)joining the queue is lifted to the smallest
*settled* counter of a waiting user, or to the last leaver's if the queue is empty (VTC's
lift, ``fairserve_floor``). Settled = the counter less the expected output pre-charged for
calls not yet settled: a pre-charge is no floor until it settles, so a refund never leaves
its user below a floor a newcomer was lifted to. Settled counters never fall, so neither
does the floor, and a backlogged user's counter never falls below any floor issued. Users
with nothing queued or running whose counter is at or below the floor are forgotten
(``forget_idle``, default on): they would be lifted to the floor anyway, so no decision
changes, and the state stays bounded.

Selection (``interaction_first``): waiting calls that continue an interaction already in
flight go first, least-served user first, then the earliest request of the least-served user
(Alg. 1 l.30-37). ``"running"`` is the paper's reading (an interaction with a call in the
running batch); ``"started"`` (default, *beyond the paper*) also counts interactions whose
earlier calls have finished but that have not ended (a closed-loop agent's next call arrives
only after its previous one finished, so it is never "running" when its next call waits);
``"off"`` disables it. An interaction ends ``interaction_timeout_s`` after its last activity
(a call's arrival, admission or finish) once none of its calls is queued or running: a call
that waits or runs longer than the timeout never ends its interaction (its next call is no
new interaction, so it is never throttled).

**OIT** (``throttle=True``; ``fairserve-w`` is the same policy without it): at arrival,
count the request against its user's and app's window, then — only when the worker is
*overloaded* and the request *starts* a new interaction — reject it if the user is over its
limit, else if the app is over its limit (``fairserve_oit``). Never mid-interaction (those
calls wait); never while not overloaded. Overloaded = more than ``max_waiting`` requests
waiting, or KV usage ≥ ``kv_threshold`` as reported by a load probe the host attaches with
``attach_load(probe)`` (the scheduler does not show KV usage to ``on_arrival``; without a
probe only the waiting bound applies). A request with no ``interaction_id`` is an
interaction of its own (it starts one).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from sgl_fair.policies.base import (
    BasePolicy,
    Rejection,
    SchedulerView,
    group_by_client,
    register,
)
from sgl_fair.policies.fairserve_floor import Floors
from sgl_fair.policies.fairserve_oit import Limits, LoadProbe, Windows
from sgl_fair.policies.fairserve_queue import WaitingIndex, reference_walk
from sgl_fair.request import ClientId, Request

CHARGE_MODES = ("admission", "finish")
# Learned (app, stage) weights held at most: apps and stages come from clients, so past this
# many the least recently finished stage is forgotten (it starts again from its seed).
MAX_STAGES = 4096
INTERACTION_MODES = ("started", "running", "off")


@register("fairserve")
class FairServe(BasePolicy):
    shares_running = True
    shares_oit_options = True
    orders_by_time = True  # interaction timeouts and OIT windows at view.now

    @dataclass(frozen=True)
    class Config:
        alpha: float = 1.0
        beta: float = 2.0
        gamma: float = 1.0
        priority: Mapping[ClientId, float] = field(default_factory=dict)
        system_lens: Mapping[str, int] = field(default_factory=dict)
        stage_weights: Mapping[str, float] = field(default_factory=dict)
        seed_count: int = 10
        learn: bool = True
        # Forget a user with nothing queued or running whose counter is at or below the
        # lift floor: it changes no decision (``fairserve_floor``) and bounds the state.
        forget_idle: bool = True
        charge: str = "admission"
        interaction_first: str = "started"
        interaction_timeout_s: float = 120.0
        # OIT
        throttle: bool = True
        max_waiting: int = 256
        kv_threshold: float = 0.9
        limits: Limits = field(default_factory=Limits)

        def __post_init__(self) -> None:
            if min(self.alpha, self.beta, self.gamma) < 0 or not (
                self.alpha + self.beta + self.gamma > 0
            ):
                raise ValueError("fairserve: alpha, beta, gamma must be >= 0, not all 0")
            if self.charge not in CHARGE_MODES:
                raise ValueError(
                    f"fairserve: charge must be one of {', '.join(CHARGE_MODES)} "
                    f"(got {self.charge!r})"
                )
            if self.interaction_first not in INTERACTION_MODES:
                raise ValueError(
                    f"fairserve: interaction_first must be one of {', '.join(INTERACTION_MODES)}"
                    f" (got {self.interaction_first!r})"
                )
            bad = {k: v for k, v in {**self.priority, **self.stage_weights}.items() if not v > 0}
            if bad:
                raise ValueError(f"fairserve: priority and stage_weights must be > 0 (got {bad})")
            if self.seed_count < 1:
                raise ValueError(f"fairserve: seed_count must be >= 1 (got {self.seed_count})")
            if self.max_waiting < 0 or not 0 < self.kv_threshold <= 1:
                raise ValueError("fairserve: max_waiting must be >= 0, kv_threshold in (0, 1]")
            if isinstance(self.limits, Mapping):  # from make_policy(..., limits={...})
                object.__setattr__(self, "limits", Limits(**self.limits))

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.counters: dict[ClientId, float] = {}
        self._floors = Floors(self.counters, self.active)
        self.windows = Windows(self.config.limits)
        # (app, stage) -> (mean, n), least recently learned first; `_out_mean` has its keys
        self._stage_mean: OrderedDict[tuple[str, int], tuple[float, int]] = OrderedDict()
        self._out_mean: dict[tuple[str, int], float] = {}
        # id(req) -> (service charged at admission, the w it was priced at (None: the w at
        # finish), the part of it that is expected output, unsettled), from the 1st admission
        self._charged: dict[int, tuple[float, float | None, float]] = {}
        self._interactions: dict[str, float] = {}  # interaction id -> last activity (s)
        self._open: dict[str, int] = {}  # interaction id -> its calls queued or running
        self._open_calls: dict[int, str] = {}  # id(req) -> its interaction, while open
        self._started: set[str] = set()  # interactions with an admitted call
        self._num_waiting = 0
        # The waiting queue by user and interaction, with lazy heaps by counter: a pass
        # costs O(admitted · log users), and the lift's active minimum O(log users).
        self._index = WaitingIndex(self.counter)
        self._load: LoadProbe | None = None
        self._now = 0.0
        self.num_throttled = 0
        # False: every pass rebuilds its groups from `waiting` (the reference path, for
        # tests and the bench). Passes that took it although True: `num_fallbacks`.
        self.incremental = True
        self.num_fallbacks = 0

    def attach_load(self, probe: LoadProbe | None) -> None:
        """Give OIT the worker's KV usage in [0, 1] (see the module docstring)."""
        self._load = probe

    # ---------------------------------------------------------------- costs

    def counter(self, user: ClientId) -> float:
        return self.counters.get(user, 0.0)

    service_received = counter  # the share guard's measure (policies/base.py)

    def settled(self, user: ClientId) -> float:
        """``user``'s counter less the expected output pre-charged for calls not yet settled
        (``charge="admission"``): what the counter lift reads (``fairserve_floor``)."""
        return self._floors.settled(user)

    def _key(self, req: Request) -> tuple[str, int]:
        return (req.app or "", req.stage)

    def raw_cost(self, req: Request, output_len: float) -> float:
        cfg = self.config
        declared = req.system_len
        system = cfg.system_lens.get(req.app or "", 0) if declared is None else declared
        system = min(system, req.input_len)
        return cfg.alpha * (req.input_len - system) + cfg.beta * system + cfg.gamma * output_len

    def stage_weight(self, req: Request) -> float | None:
        """``w(app, stage)``: learned mean, else the config seed, else None (unknown stage)."""
        learned = self._stage_mean.get(self._key(req))
        if learned is not None:
            return learned[0]
        return self._seed(req)

    def _seed(self, req: Request) -> float | None:
        seeds = self.config.stage_weights
        app = req.app or ""
        return seeds.get(f"{app}/{req.stage}", seeds.get(app))

    def service(self, req: Request, output_len: float, w: float | None = None) -> float:
        """The call's cost at ``w`` (default: the stage's current ``w(app, stage)``)."""
        w = w if w is not None else self._weight_now(req)
        return self.config.priority.get(req.client, 1.0) * self.raw_cost(req, output_len) / w

    def _weight_now(self, req: Request) -> float:
        w = self.stage_weight(req)
        if w is None:  # cold, unseeded stage: w := this call's cost at its max output
            w = self.raw_cost(req, req.max_new_tokens)
        return max(w, 1e-9)

    def _expected_output(self, req: Request) -> float:
        return min(self._out_mean.get(self._key(req), req.max_new_tokens), req.max_new_tokens)

    def _learn(self, req: Request) -> None:
        if not self.config.learn:
            return
        key = self._key(req)
        raw = self.raw_cost(req, req.num_output)
        if key in self._stage_mean:
            mean, n = self._stage_mean[key]
        else:
            seed = self._seed(req)
            mean, n = (seed, self.config.seed_count) if seed is not None else (0.0, 0)
        self._stage_mean[key] = (mean + (raw - mean) / (n + 1), n + 1)
        self._stage_mean.move_to_end(key)
        prev = self._out_mean.get(key)
        self._out_mean[key] = req.num_output if prev is None else 0.8 * prev + 0.2 * req.num_output
        if len(self._stage_mean) > MAX_STAGES:
            oldest, _ = self._stage_mean.popitem(last=False)
            del self._out_mean[oldest]

    def learned_stages(self) -> int:
        """How many (app, stage) weights the policy holds (at most ``MAX_STAGES``)."""
        return len(self._stage_mean)

    # ---------------------------------------------------------------- arrival (lift + OIT)

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        self._now = now
        starts = self._starts_interaction(req, now)
        if self.config.throttle:
            self.windows.count(req.client, req.app, now)
            # ``oit_checked``: the router's cluster OIT let it through, having seen every call
            # of its interaction (this worker may have seen only some: refusing here would cut
            # an interaction mid-way, e.g. one call of a fan-out whose others run elsewhere).
            if starts and not req.oit_checked and self.overloaded():
                over = self.windows.over_limit(req.client, req.app, now)
                if over is not None:
                    self.num_throttled += 1
                    reason, retry_after, limit, limit_max = over
                    return Rejection(
                        reason, retry_after, limit, limit_max, self.windows.limits.window_s
                    )
        if req.interaction_id is not None:
            iid = req.interaction_id
            self._interactions[iid] = now
            self._open[iid] = self._open.get(iid, 0) + 1
            self._open_calls[id(req)] = iid
            self._index.mark(iid)
        rejoining = not self.active.is_active(req.client)
        floor = self._floor() if rejoining else 0.0
        self.active.enqueue(req.client)
        if rejoining:  # the counter lift: no credit carried over an idle spell
            self._set(req.client, max(self.counter(req.client), floor))
        self._num_waiting += 1
        self._index.add(req)
        return None

    def overloaded(self) -> bool:
        if self._num_waiting > self.config.max_waiting:
            return True
        return self._load is not None and self._load() >= self.config.kv_threshold

    def _starts_interaction(self, req: Request, now: float) -> bool:
        return not self.in_flight(req.interaction_id, now)

    def in_flight(self, interaction_id: str | None, now: float) -> bool:
        """Whether ``interaction_id`` has started and not yet ended: a call of it is queued
        or running, or its last activity is at most ``interaction_timeout_s`` old."""
        if interaction_id is None:
            return False
        if self._open.get(interaction_id, 0) > 0:
            return True
        last = self._interactions.get(interaction_id)
        return last is not None and now - last <= self.config.interaction_timeout_s

    def _close(self, req: Request, now: float) -> None:
        """``req`` left for good (finished or aborted): one call fewer open in its interaction."""
        iid = self._open_calls.pop(id(req), None)
        if iid is None:
            return
        n = self._open[iid] - 1
        if n:
            self._open[iid] = n
        else:
            del self._open[iid]
        if iid in self._interactions:
            self._interactions[iid] = max(self._interactions[iid], now)
        self._index.mark(iid)

    def _floor(self) -> float:
        """The smallest *settled* counter of a waiting user, or the last leaver's when none
        waits (``fairserve_floor``: pre-charged output is no floor until it settles)."""
        return self._floors.floor()

    def _set(self, user: ClientId, value: float) -> None:
        """The only writer of ``counters`` (the index's and the floor's heaps follow)."""
        self.counters[user] = value
        self._index.touch(user)
        self._floors.touch(user)

    # ---------------------------------------------------------------- accounting

    def on_admitted(self, req: Request, extend_len: int) -> None:
        super().on_admitted(req, extend_len)
        self._num_waiting -= 1
        self._index.remove(req)
        if req.interaction_id is not None:
            self._started.add(req.interaction_id)
            self._interactions[req.interaction_id] = max(
                self._interactions.get(req.interaction_id, self._now), self._now
            )
            self._index.mark(req.interaction_id)
        if req.num_retractions > 0:
            return  # re-admitted after a retraction: charged at its first admission
        if self.config.charge == "admission":
            # Priced once: the settlement at finish uses the same w, so learning between
            # admission and finish never re-prices a call.
            w = self._weight_now(req)
            service = self.service(req, self._expected_output(req), w)
            pending = max(service - self.service(req, 0, w), 0.0)
            self._floors.admitted(req.client, pending)
            self._set(req.client, self.counter(req.client) + service)
            self._charged[id(req)] = (service, w, pending)
        else:
            self._floors.admitted(req.client, 0.0)
            self._charged[id(req)] = (0.0, None, 0.0)

    def on_retracted(self, req: Request) -> None:
        super().on_retracted(req)
        self._num_waiting += 1
        self._index.add(req)  # back in the queue (and in the heaps)
        self._floors.touch(req.client)

    def on_aborted(self, req: Request, waiting: bool) -> None:
        if waiting:
            self._num_waiting -= 1
            self._index.remove(req)
        super().on_aborted(req, waiting)  # an admitted one finishes (``on_finished``)
        self._close(req, self._now)
        if self.config.forget_idle:
            self._floors.forget(req.client)

    def on_finished(self, req: Request) -> None:
        """Settle: the call's true cost replaces whatever was charged for it (Alg. 1 l.43-48)."""
        entry = self._charged.pop(id(req), None)
        if entry is None:  # never seen admitted (a host's own bookkeeping): charge it all
            charged, w = 0.0, None
        else:
            charged, w, pending = entry
            self._floors.settled_call(req.client, pending)
        self._set(
            req.client, self.counter(req.client) + self.service(req, req.num_output, w) - charged
        )
        self._close(req, req.finish_s or self._now)
        self._learn(req)
        if self.config.forget_idle:
            self._floors.forget(req.client)
        if len(self._interactions) > 4 * (self._num_waiting + 1024):
            self._forget_ended(req.finish_s or self._now)

    def _forget_ended(self, now: float) -> None:
        timeout = self.config.interaction_timeout_s
        self._interactions = {
            i: t for i, t in self._interactions.items() if now - t <= timeout or i in self._open
        }
        self._started &= self._interactions.keys()
        self._index.mark_all()

    # ---------------------------------------------------------------- selection

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        """Continuing calls of in-flight interactions first (least-served user first), then
        the earliest request of the least-served user; counters re-read after every admission.

        From the incremental index (``fairserve_queue``) when ``waiting`` is the queue the
        policy's hooks describe; otherwise (a host passing part of its queue) the per-pass
        rebuild from ``waiting`` — the same order, at O(waiting).
        """
        self._now = view.now
        index = self._index
        if not self.incremental or not index.matches(waiting):
            self.num_fallbacks += self.incremental
            return self._reference_order(waiting, view)
        mode = self.config.interaction_first
        if mode == "running":
            live = {r.interaction_id for r in view.running if r.interaction_id is not None}
            mine: dict[ClientId, list[Request]] = {}
            for iid in live:
                for req in index.by_iid.get(iid, ()):
                    mine.setdefault(req.client, []).append(req)
            first = {u: deque(sorted(q, key=Request.arrival_key)) for u, q in mine.items()}
            return index.walk(first)
        if mode == "off":
            return index.walk({})
        index.refresh(view.now, self._continues_iid, self._deadline)
        return index.walk(None)

    def _reference_order(
        self, waiting: Sequence[Request], view: SchedulerView
    ) -> Iterator[Request]:
        """The per-pass rebuild: groups and continuing calls from ``waiting``, O(waiting)."""
        groups = group_by_client(waiting)
        cont = self._continuing(groups, view)
        queues = {u: deque(reqs) for u, reqs in groups.items()}
        return reference_walk([cont, queues], set(), self.counter)

    def _continues_iid(self, iid: str, now: float) -> bool:
        return iid in self._started and self.in_flight(iid, now)

    def _deadline(self, iid: str) -> float:
        """When ``iid`` ends unless it sees activity (its calls stop continuing after); never
        while a call of it is open (its close marks it for a re-check)."""
        if iid in self._open:
            return float("inf")
        return self._interactions[iid] + self.config.interaction_timeout_s

    def _continuing(
        self, groups: Mapping[ClientId, list[Request]], view: SchedulerView
    ) -> dict[ClientId, deque[Request]]:
        mode = self.config.interaction_first
        if mode == "off":
            return {}
        if mode == "running":
            live = {r.interaction_id for r in view.running if r.interaction_id is not None}
        else:
            live = None
        now = view.now
        out: dict[ClientId, deque[Request]] = {}
        for u, reqs in groups.items():
            mine = [
                r
                for r in reqs
                if r.interaction_id is not None
                and (r.interaction_id in live if live is not None else self._continues(r, now))
            ]
            if mine:
                out[u] = deque(mine)
        return out

    def _continues(self, req: Request, now: float) -> bool:
        """An earlier call of ``req``'s interaction was admitted (it is not the first call)."""
        return req.interaction_id in self._started and self.in_flight(req.interaction_id, now)

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        assert self._num_waiting >= 0, self._num_waiting
        assert sum(1 for c in self.active.clients() if self.active.is_active(c)) == len(self.active)
        index = self._index
        assert len(index) == self._num_waiting, (len(index), self._num_waiting)
        assert index.queues.keys() == set(self.active.clients()), "index users != active"
        now = index.refreshed_at
        index.check(lambda iid: self._continues_iid(iid, now))

    def check_waiting(self, waiting: Sequence[Request]) -> None:
        """The index holds exactly ``waiting`` (the scheduler's queue); O(waiting)."""
        assert sorted(map(id, waiting)) == sorted(self._index.tracked), "index != waiting"


@register("fairserve-w")
class FairServeW(FairServe):
    """WSC only: FairServe's counters and selection, no throttling (the paper's ablation)."""

    @dataclass(frozen=True)
    class Config(FairServe.Config):
        throttle: bool = False
