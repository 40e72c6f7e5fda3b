"""The router-policy seam: one small Protocol, a decorator registry, shared helpers.

A router policy picks a worker for each request from what the router knows — the
prompt's match in the global tree and the router's view of the workers — and is told
about dispatches, completions and dead workers:

    select(req, match, view) -> worker     # must be one of view.workers
    on_dispatched(req, worker, match, view) # after the router recorded the dispatch
    on_finished(msg, view)                  # msg.ok is False for rejected / aborted
    on_worker_removed(worker)

The router never branches on a policy's name; each policy owns a frozen ``Config``
dataclass that ``make_router_policy`` builds from keyword options.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from sgl_fair.messages import Finished
from sgl_fair.registry import Registry
from sgl_fair.request import Request
from sgl_fair.router.global_tree import GlobalMatch, GlobalTree


@runtime_checkable
class RouterView(Protocol):
    """What a policy may ask the router."""

    @property
    def now(self) -> float: ...

    @property
    def workers(self) -> Sequence[int]:
        """Alive worker ids, ascending."""
        ...

    def queue_len(self, worker: int) -> int:
        """Requests dispatched to ``worker`` and not yet reported finished."""
        ...

    @property
    def tree(self) -> GlobalTree: ...


@runtime_checkable
class RouterPolicy(Protocol):
    name: ClassVar[str]

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int: ...

    def on_dispatched(
        self, req: Request, worker: int, match: GlobalMatch, view: RouterView
    ) -> None: ...

    def on_finished(self, msg: Finished, view: RouterView) -> None: ...

    def on_worker_removed(self, worker: int) -> None: ...


@runtime_checkable
class PeerServiceAware(Protocol):
    """A router policy that keeps per-client service (D2LPM) and takes the service other
    router replicas dispatched, as the workers' reports bring it (``router/replica.py``)."""

    def service_weights(self) -> tuple[float, float]:
        """``(w_e, w_o)``: service units per extend token charged and per output token."""
        ...

    def on_peer_service(
        self, worker: int, client: str, extend: int, output: int, view: RouterView
    ) -> None:
        """Charge ``client`` on ``worker`` for ``extend`` and ``output`` tokens that other
        replicas dispatched (never this replica's own: the replica state excludes them)."""
        ...


class BaseRouterPolicy:
    """No-op hooks; subclasses define ``Config`` (a frozen dataclass) and ``select``."""

    name: ClassVar[str] = "base"
    Config: ClassVar[type]

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.Config()

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        raise NotImplementedError

    def on_dispatched(
        self, req: Request, worker: int, match: GlobalMatch, view: RouterView
    ) -> None:
        return None

    def on_finished(self, msg: Finished, view: RouterView) -> None:
        return None

    def on_worker_removed(self, worker: int) -> None:
        return None


def least_queued(workers: Iterable[int], view: RouterView) -> int:
    """The worker with the fewest queued requests; ties go to the first, i.e. the lowest id.

    ``workers`` must be ascending (``view.workers`` or a sub-list of it, in order).
    """
    return min(workers, key=view.queue_len)


def next_in_cycle(workers: Sequence[int], last: int | None) -> int:
    """Round robin over ascending ``workers``: the first id after ``last``, wrapping around.

    Keyed by the last id rather than an index, so workers joining or leaving do not make
    the cycle skip or repeat anyone.
    """
    if last is not None:
        for u in workers:
            if u > last:
                return u
    return workers[0]


def check_positive(policy: str, **values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{policy}: {key} must be > 0 (got {value})")


# ---------------------------------------------------------------- registry


def _load_builtin() -> None:
    # Importing the modules runs their @register_router_policy decorators.
    from sgl_fair.router.policies import (  # noqa: F401
        cache_aware,
        d2lpm,
        least_load,
        per_client_rr,
        preble,
        rr,
    )


ROUTER_POLICIES = Registry("router policy", load=_load_builtin)
register_router_policy = ROUTER_POLICIES.register  # @register_router_policy("d2lpm")
router_policy_names = ROUTER_POLICIES.names
router_policy_class = ROUTER_POLICIES.get


def make_router_policy(name: str, **options: Any) -> RouterPolicy:
    """Build a router policy by name; unknown names or options raise a one-line ValueError."""
    return ROUTER_POLICIES.make(name, **options)
