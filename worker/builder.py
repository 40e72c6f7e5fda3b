"""One worker builder: KV allocator → prefix cache → scheduler → engine, for every engine.

The simulator (``sim.runner.make_sim_worker``), the torch engine
(``torch_engine.runner.make_torch_worker``), the live worker (``live.build_core``), the
cluster simulator and the experiments all assemble a worker here::

    scheduler, engine = build_worker(policy=make_policy("vtc"), engine="sim",
                                     cost_model=CostModel.from_names("A10G-24GB", "Llama-2-7B"))

Engines register by name (``register_engine``); the builder asks the engine's *kind* what it
needs and never branches on its name. A kind (``EngineKind``) declares:

* ``Config``: a frozen dataclass of the engine's own options (``engine_opts``; an unknown one
  is a one-line ``ValueError`` naming the options there are);
* ``exact_kv``: whether the prefix cache must name every token's KV slot (a real engine reads
  its KV there; the simulator only counts tokens);
* ``synchronous``: whether ``run`` returns after the step's time has passed (a real engine),
  so a wall-clock loop must not wait the step's duration again;
* ``default_cost_model()``: the step-cost model when none is given (iteration costs for
  batch-selecting policies; the simulator's step durations), or a ``ValueError`` if it
  needs one;
* ``default_kv_tokens(cost_model)``: the KV pool when ``kv_tokens`` is not given;
* ``make_engine(config, scheduler, allocator, cost_model)``: the engine over the built
  scheduler and its allocator;
* ``live_parts(cfg)`` and ``describe(cfg)``: ``build_worker`` keyword arguments and the
  engine's one-line name for the live worker's ``LiveWorkerConfig``;
* ``context_len(parts)``: the longest sequence (prompt and output) the engine built from
  ``live_parts``'s ``parts`` serves, or None if it has no bound; a live worker's Hello
  carries it to the router.

The built-in kinds (``sim``, ``torch``) are imported only when first asked for, so building
a simulated worker never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from sgl_fair.policies.base import Policy
from sgl_fair.registry import build_config
from sgl_fair.worker.engine import Engine
from sgl_fair.worker.kv.base import KVAllocator
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel


class EngineKind(Protocol):
    """How one engine joins a worker (see the module docstring for each member's contract)."""

    Config: ClassVar[type]
    exact_kv: ClassVar[bool]
    synchronous: ClassVar[bool]

    def default_cost_model(self) -> CostModel: ...

    def default_kv_tokens(self, cost_model: CostModel) -> int: ...

    def make_engine(
        self, config: Any, scheduler: Scheduler, allocator: KVAllocator, cost_model: CostModel
    ) -> Engine: ...

    def live_parts(self, cfg: Any) -> dict[str, Any]: ...

    def describe(self, cfg: Any) -> str: ...

    def context_len(self, parts: Mapping[str, Any]) -> int | None: ...


# name -> the kind, or "module:attribute" where it lives (imported on first use)
_ENGINES: dict[str, EngineKind | str] = {
    "sim": "sgl_fair.worker.sim.engine:SimEngineKind",
    "torch": "sgl_fair.worker.torch_engine.runner:TorchEngineKind",
}


def register_engine(name: str, kind: EngineKind | str) -> None:
    """File ``kind`` (an ``EngineKind`` instance or ``"module:attribute"``) under ``name``."""
    if name in _ENGINES:
        raise ValueError(f"engine {name!r} registered twice")
    _ENGINES[name] = kind


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def engine_kind(name: str) -> EngineKind:
    """The kind registered as ``name``; an unknown name is a one-line ``ValueError``."""
    try:
        kind = _ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown engine {name!r}; choose one of: {', '.join(engine_names())}"
        ) from None
    if isinstance(kind, str):
        module, _, attr = kind.partition(":")
        kind = getattr(importlib.import_module(module), attr)()
        _ENGINES[name] = kind
    return kind


def engine_config(kind: EngineKind, name: str, options: Mapping[str, Any]) -> Any:
    """``kind.Config(**options)``; an unknown option is a one-line ``ValueError``."""
    return build_config("engine", name, kind.Config, options)


def build_worker(
    *,
    policy: Policy,
    engine: str = "sim",
    engine_opts: Mapping[str, Any] | None = None,
    cost_model: CostModel | None = None,
    kv_tokens: int | None = None,
    allocator: str = "token",
    allocator_opts: Mapping[str, Any] | None = None,
    config: SchedulerConfig | None = None,
) -> tuple[Scheduler, Engine]:
    """A scheduler over a prefix cache on allocator ``allocator`` (``kv_tokens`` slots, else
    the engine's default) and engine ``engine`` with ``engine_opts``; step costs from
    ``cost_model`` (else the engine's default)."""
    kind = engine_kind(engine)
    options = engine_config(kind, engine, engine_opts or {})
    cost = cost_model if cost_model is not None else kind.default_cost_model()
    capacity = kv_tokens if kv_tokens is not None else kind.default_kv_tokens(cost)
    alloc = make_allocator(allocator, capacity, **dict(allocator_opts or {}))
    kv = PrefixKVCache(alloc, exact=kind.exact_kv)
    scheduler = Scheduler(policy=policy, kv=kv, config=config, cost=cost.step_time)
    return scheduler, kind.make_engine(options, scheduler, alloc, cost)
