"""The local-policy seam: one small Protocol, a decorator registry, shared helpers.

A policy sees requests and accounting events only (ARCHITECTURE "seams" #1):

    on_arrival(req, now) -> Rejection | None   # admission control (RPM, FairServe OIT)
    order(waiting, view) -> Iterator[Request]  # the admission walk, lazily; `waiting`
                                               # is in arrival order
    on_admitted(req, extend_len)               # charged *before* the walk resumes
    on_tokens(req, n)                          # n output tokens generated
    on_finished(req) / on_retracted(req)
    on_aborted(req, waiting)                   # cancelled; `waiting`: it was in the queue

``order`` is a generator so that policies whose next choice depends on the
previous admission (VTC's argmin counter, DLPM's deficit walk) are exact: the
scheduler pulls one request, tries to admit it, and on success calls
``on_admitted`` before pulling the next; on failure it closes the generator.

Batch selection (seam #1b, optional; BROS and its RR baseline). A policy that defines

    select_batch(candidates, view, cost) -> list[Request]

chooses the iteration's running set itself: ``candidates`` are the waiting requests (arrival
order) then the running ones; the result lists those to run this iteration, most important
first — running ones decode one token, waiting ones are admitted in that order under the
scheduler's memory and prefill-budget rules (it stops at the first that does not fit), and
running ones left out are paused with their KV. ``cost(prefill_chunks=[(num_new,
num_context)], decode_context_lens=[...]) -> seconds`` is the iteration cost model (the
simulator's ``CostModel.step_time``; None if the scheduler was built without one); it reads
its list arguments during the call and keeps none (BROS reuses them). The ``view`` may also
offer ``kv_need(req)`` and ``kv_room(req)`` (the scheduler's admission test, per class),
``kv_freed_by(victim, req)`` (the room retracting running ``victim`` adds to ``req``'s) and
``checkpointed_slots(req)``. The scheduler retracts paused (unchosen) requests to make room
for the picks, in order: an RT pick only BE requests, a BE pick (the first) any. Such a
policy's ``order`` is never called; ``victim(pool)``, if defined, picks whom to retract.
Policies without ``select_batch`` take the admission walk above, unchanged.

Service measure (optional; the scheduler's share guard, ``worker/share_guard.py``). A policy
that defines ``service_received(client) -> float`` — weighted service received, comparable across
clients, lifted like VTC's counter so idling banks no credit — lets the guard make room only
for a client that the policy itself does not consider ahead: a waiting client may take
running slots from another only while ``service_received(waiting) <= service_received(holder)``.

Capabilities. Each optional part is a Protocol below — ``BatchSelecting``, ``Retracting``,
``ServiceMeasure``, ``LoadAware``, ``Weighted``, ``Predicting`` — and each class-level trait a
``ClassVar`` of ``BasePolicy`` (``shares_running``, ``uses_service_classes``,
``admission_order``). Hosts check them once, into ``PolicyCaps.of(policy)`` (an instance:
its bound hooks) or ``PolicyTraits.of(cls)`` (a class, before one is built); nothing probes a
policy's attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from sgl_fair.registry import Registry
from sgl_fair.request import ClientId, Request


@dataclass(frozen=True)
class Rejection:
    """Why a request was refused at arrival (HTTP 429 in serving)."""

    reason: str
    retry_after_s: float | None = None
    # Which admission limit refused it, for clients and metrics (FairServe's OIT: "user" or
    # "app"); with ``limit_max`` requests per ``limit_window_s``. None: not a windowed limit.
    limit: str | None = None
    limit_max: int | None = None
    limit_window_s: float | None = None


@runtime_checkable
class SchedulerView(Protocol):
    """What a policy may ask the scheduler during ``order``.

    A view may also offer ``prefix_lens(reqs) -> list[int]``, ``prefix_len`` of each request
    in one call; ``lpm_order`` uses it where present (the SGLang plugin's view answers a whole
    queue's memoised matches in one loop). It must equal asking ``prefix_len`` one by one.
    And ``lpm_groups() -> dict[client, deque[(key, request)]] | None``: every waiting client's
    requests in ``lpm_order``'s order, keys ascending in that global order (the plugin keeps
    them across passes, ``worker/sglang/lpm_index.py``); None where it cannot answer.
    """

    @property
    def now(self) -> float: ...

    def prefix_len(self, req: Request) -> int:
        """Tokens of ``req`` already cached on this worker (no side effects)."""
        ...

    @property
    def running(self) -> Sequence[Request]: ...


@runtime_checkable
class Policy(Protocol):
    name: ClassVar[str]

    def on_arrival(self, req: Request, now: float) -> Rejection | None: ...

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]: ...

    def on_admitted(self, req: Request, extend_len: int) -> None: ...

    def on_tokens(self, req: Request, n: int) -> None: ...

    def on_finished(self, req: Request) -> None: ...

    def on_retracted(self, req: Request) -> None: ...

    def on_aborted(self, req: Request, waiting: bool) -> None: ...


# ---------------------------------------------------------------- capabilities


@runtime_checkable
class BatchSelecting(Protocol):
    """Seam #1b (module docstring): the policy chooses each iteration's running set."""

    def select_batch(self, candidates: Sequence[Request], view: Any, cost: Any) -> list[Request]:
        """The requests to run this iteration, most important first, from ``candidates``
        (waiting in arrival order, then running). Running ones decode a token; waiting ones
        are admitted in this order while they fit; running ones left out are paused with
        their KV. ``cost(prefill_chunks=..., decode_context_lens=...) -> seconds`` prices an
        iteration (None where the scheduler has no cost model); keep none of its arguments."""
        ...


@runtime_checkable
class Retracting(Protocol):
    """The policy picks whom the scheduler retracts when KV runs out."""

    def victim(self, pool: Sequence[Request]) -> Request:
        """One request of ``pool`` (never empty: running requests) to retract."""
        ...


@runtime_checkable
class ServiceMeasure(Protocol):
    """Weighted service per client, for the share guard (module docstring)."""

    def service_received(self, client: ClientId) -> float:
        """Weighted service ``client`` has received, comparable across clients and lifted
        so that idling banks no credit; no side effects."""
        ...


# The worker's KV usage in [0, 1] (neither free nor evictable), read when the policy likes.
LoadProbe = Callable[[], float]


@runtime_checkable
class LoadAware(Protocol):
    """A policy that acts only under overload (FairServe's OIT) reads the worker's load."""

    def attach_load(self, probe: LoadProbe | None) -> None:
        """Read the worker's KV usage through ``probe`` from now on (None: detach). The
        scheduler attaches its ``kv_usage`` when it is built; a host may attach another."""
        ...


@runtime_checkable
class Weighted(Protocol):
    """Per-client weights: a client of weight w is owed w times the service of weight 1."""

    @classmethod
    def weight_options(cls, weights: Mapping[ClientId, float]) -> dict[str, Any]:
        """The options (``make_policy`` keywords) that give a new policy these weights (a
        host with a tenant table passes them when the user set none)."""
        ...

    def client_weights(self) -> Mapping[ClientId, float]:
        """This policy's weights; a client not named weighs 1."""
        ...


@runtime_checkable
class Predicting(Protocol):
    """A policy that charges predicted output lengths names its predictor (for reports)."""

    @property
    def predictor(self) -> str:
        """The predictor's name (``"none"``: charges actual tokens only)."""
        ...


@dataclass(frozen=True)
class PolicyCaps:
    """A policy instance's optional hooks, checked once (``PolicyCaps.of``): each is the bound
    method, or None where the policy lacks that capability."""

    select_batch: Callable[..., list[Request]] | None
    victim: Callable[[Sequence[Request]], Request] | None
    service_received: Callable[[ClientId], float] | None
    attach_load: Callable[[LoadProbe | None], None] | None
    weights: Mapping[ClientId, float]
    predictor: str | None
    # A batch-selecting policy's choice when a chosen decode finds no KV block: True, retract
    # that request itself (vLLM's recompute); False, retract paused requests for it.
    recomputes_blocked: bool

    @classmethod
    def of(cls, policy: object) -> PolicyCaps:
        return cls(
            select_batch=policy.select_batch if isinstance(policy, BatchSelecting) else None,
            victim=policy.victim if isinstance(policy, Retracting) else None,
            service_received=(
                policy.service_received if isinstance(policy, ServiceMeasure) else None
            ),
            attach_load=policy.attach_load if isinstance(policy, LoadAware) else None,
            weights=policy.client_weights() if isinstance(policy, Weighted) else {},
            predictor=policy.predictor if isinstance(policy, Predicting) else None,
            recomputes_blocked=isinstance(policy, BasePolicy) and policy.recomputes_blocked,
        )


@dataclass(frozen=True)
class PolicyTraits:
    """What a policy class declares, before one is built (``PolicyTraits.of(cls)``): its
    ``BasePolicy`` class flags and which capability protocols it implements."""

    shares_running: bool
    uses_service_classes: bool
    admission_order: bool
    batch_selecting: bool
    weighted: bool
    shares_oit_options: bool
    orders_by_time: bool
    asks_prefix_len: bool

    @classmethod
    def of(cls, policy_cls: type) -> PolicyTraits:
        base = issubclass(policy_cls, BasePolicy)  # else it declares no class flags
        return cls(
            shares_running=base and policy_cls.shares_running,  # type: ignore[attr-defined]
            uses_service_classes=base and policy_cls.uses_service_classes,  # type: ignore[attr-defined]
            admission_order=base and policy_cls.admission_order,  # type: ignore[attr-defined]
            batch_selecting=issubclass(policy_cls, BatchSelecting),
            weighted=issubclass(policy_cls, Weighted),
            shares_oit_options=base and policy_cls.shares_oit_options,  # type: ignore[attr-defined]
            orders_by_time=base and policy_cls.orders_by_time,  # type: ignore[attr-defined]
            asks_prefix_len=base and policy_cls.asks_prefix_len,  # type: ignore[attr-defined]
        )


class BasePolicy:
    """No-op defaults plus the waiting-count bookkeeping most policies need.

    Subclasses define a frozen ``Config`` dataclass; ``make_policy`` builds it from options.
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type]
    # A fair policy: the live server turns the scheduler's share guard on for it by default
    # (``--share-guard auto``; ``worker/share_guard.py``), so a flood cannot hold the running
    # batch while another client waits. Baselines keep the papers' behaviour.
    shares_running: ClassVar[bool] = False
    # Orders by RT/BE class: hosts carry each request's class to it (BROS; the SGLang plugin
    # then runs SGLang's priority scheduling).
    uses_service_classes: ClassVar[bool] = False
    # A ``BatchSelecting`` policy whose ``order`` is also a full admission order, so a host
    # that cannot choose the running batch (SGLang's scheduler) may still run it (BROS).
    admission_order: ClassVar[bool] = False
    # Set per instance by a batch-selecting policy (BROS's ``recompute_blocked``): a chosen
    # decode that finds no KV block is retracted itself (``PolicyCaps.recomputes_blocked``).
    recomputes_blocked: bool = False
    # Its options include the OIT's (``limits``, windows): the router's cluster OIT takes
    # them as its defaults (``--cluster-oit on`` with FairServe; ``apps/launch/config.py``).
    shares_oit_options: ClassVar[bool] = False
    # Its order reads the clock (``view.now``: deadlines, timeouts), so a host must give each
    # pass the current time even when no request arrived (the SGLang plugin's rank clock then
    # ticks every scheduler iteration; for the others only when requests are pulled).
    orders_by_time: ClassVar[bool] = False
    # Its order may ask ``view.prefix_len`` (cache-aware: LPM, DLPM, Preble; BROS with a DLPM
    # inner order): a host keeps prefix matches for it (the SGLang plugin's shadow of
    # SGLang's cache, which costs a drain of KV events every pass); for the others it keeps none.
    asks_prefix_len: ClassVar[bool] = False

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.Config()
        self.active = ActiveClients()

    def on_arrival(self, req: Request, now: float) -> Rejection | None:
        self.active.enqueue(req.client)
        return None

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        return iter(waiting)

    def on_admitted(self, req: Request, extend_len: int) -> None:
        self.active.dequeue(req.client)

    def on_tokens(self, req: Request, n: int) -> None:
        return None

    def on_finished(self, req: Request) -> None:
        return None

    def on_retracted(self, req: Request) -> None:
        self.active.enqueue(req.client)

    def on_aborted(self, req: Request, waiting: bool) -> None:
        """A cancelled request leaves; what it was charged stays charged (it was served).

        A waiting request leaves the queue as if admitted (so the client may go inactive);
        one that was ever admitted finishes (policies settle predictions in ``on_finished``).
        """
        if waiting:
            self.active.dequeue(req.client)
        if req.admit_s is not None:
            self.on_finished(req)


class ActiveClients:
    """Counts each client's waiting requests; a client is *active* (backlogged) while > 0."""

    def __init__(self) -> None:
        self._waiting: dict[ClientId, int] = {}
        self.last_left: ClientId | None = None

    def is_active(self, client: ClientId) -> bool:
        return self._waiting.get(client, 0) > 0

    def clients(self) -> list[ClientId]:
        return list(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def enqueue(self, client: ClientId) -> bool:
        """Count one more waiting request; True when the client (re)joins the queue."""
        n = self._waiting.get(client, 0)
        self._waiting[client] = n + 1
        return n == 0

    def dequeue(self, client: ClientId) -> None:
        n = self._waiting.get(client, 0)
        if n <= 0:
            raise AssertionError(f"client {client!r} has no waiting request to dequeue")
        if n == 1:
            del self._waiting[client]
            self.last_left = client
        else:
            self._waiting[client] = n - 1


def group_by_client(waiting: Sequence[Request]) -> dict[ClientId, list[Request]]:
    """Waiting requests per client, each list in the scheduler's (arrival) order."""
    groups: dict[ClientId, list[Request]] = {}
    get = groups.get
    for req in waiting:  # on every admission pass: no list made per request
        client = req.client
        group = get(client)
        if group is None:
            groups[client] = [req]
        else:
            group.append(req)
    return groups


def waiting_groups(waiting: Sequence[Request], view: Any) -> dict[ClientId, list[Request]]:
    """``group_by_client(waiting)``, or the same groups a view keeps as requests come and go
    (a capability: ``view.waiting_by_client()``, None where it keeps none; the SGLang plugin's
    view keeps them, so a pass does not group its whole queue again)."""
    kept = getattr(view, "waiting_by_client", None)
    groups = kept() if kept is not None else None
    return group_by_client(waiting) if groups is None else groups


def client_weight(weights: Mapping[ClientId, float], client: ClientId) -> float:
    return weights.get(client, 1.0)


class WeightsOption:
    """``Weighted`` for a policy whose ``Config`` takes ``weights`` (VTC, DLPM)."""

    config: Any

    @classmethod
    def weight_options(cls, weights: Mapping[ClientId, float]) -> dict[str, Any]:
        return {"weights": dict(weights)}

    def client_weights(self) -> Mapping[ClientId, float]:
        return self.config.weights


# ---------------------------------------------------------------- registry


def _load_builtin() -> None:
    # Importing every module of this package runs their @register decorators: a new policy
    # file here is registered with no other change.
    import importlib
    import pkgutil

    import sgl_fair.policies as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")


POLICIES = Registry("policy", load=_load_builtin)
register = POLICIES.register  # class decorator: @register("vtc"); the class defines `Config`
policy_names = POLICIES.names
policy_class = POLICIES.get


def make_policy(name: str, **options: Any) -> Policy:
    """Build a policy by registry name; unknown names or options raise a one-line ValueError."""
    return POLICIES.make(name, **options)
