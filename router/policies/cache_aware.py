"""sglang-router's cache-aware policy (SPEC §3), with the defaults of its ``router_args.py``.

It keeps its *own* approximate tree of which worker was sent which prompt: it never hears
of evictions and instead trims itself to ``max_tree_tokens`` (least recently used first)
every ``eviction_interval_s``. Load is the router's queue length (requests in flight).

* Imbalanced — ``max_load - min_load > balance_abs_threshold`` and
  ``max_load > balance_rel_threshold × min_load``: the shortest queue.
* Otherwise, if the best per-worker match ratio (matched / input_len) in its own tree
  exceeds ``cache_threshold``: the best-matching worker (ties: shorter queue, lower id).
* Otherwise the least-loaded worker (older releases took the worker with the smallest tree).

Every chosen worker gets the prompt inserted into the policy's tree. Differences from the
Rust original: its tree is over characters of the text, ours over token ids, so
``max_tree_tokens`` counts tokens (sglang's ``max_tree_size`` counts characters; releases
differ between 2**24 and 2**26); ties among best matches are broken by load, not by
whichever tenant the tree visits first.

Options: ``cache_threshold`` (0.3), ``balance_abs_threshold`` (64),
``balance_rel_threshold`` (1.5), ``max_tree_tokens`` (2**24), ``eviction_interval_s`` (120.0).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_fair.request import Request
from sgl_fair.router.global_tree import GlobalMatch, GlobalTree
from sgl_fair.router.policies.base import (
    BaseRouterPolicy,
    RouterView,
    check_positive,
    least_queued,
    register_router_policy,
)


@register_router_policy("cache-aware")
class CacheAware(BaseRouterPolicy):
    @dataclass(frozen=True)
    class Config:
        cache_threshold: float = 0.3
        balance_abs_threshold: int = 64
        balance_rel_threshold: float = 1.5
        max_tree_tokens: int = 2**24
        eviction_interval_s: float = 120.0

        def __post_init__(self) -> None:
            if not 0.0 <= self.cache_threshold <= 1.0:
                raise ValueError(
                    f"cache-aware: cache_threshold must be in [0, 1] (got {self.cache_threshold})"
                )
            if not self.balance_abs_threshold >= 0:
                raise ValueError(
                    "cache-aware: balance_abs_threshold must be >= 0 "
                    f"(got {self.balance_abs_threshold})"
                )
            check_positive(
                "cache-aware",
                balance_rel_threshold=self.balance_rel_threshold,
                max_tree_tokens=self.max_tree_tokens,
                eviction_interval_s=self.eviction_interval_s,
            )

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        self.tree = GlobalTree()  # approximate: only ever told about its own dispatches
        self._last_trim_s: float | None = None

    def _maybe_trim(self, now: float) -> None:
        if self._last_trim_s is None:
            self._last_trim_s = now
        elif now - self._last_trim_s >= self.config.eviction_interval_s:
            self._last_trim_s = now
            self.tree.trim(self.config.max_tree_tokens)

    def select(self, req: Request, match: GlobalMatch, view: RouterView) -> int:
        cfg = self.config
        self._maybe_trim(view.now)
        workers = view.workers
        loads = [view.queue_len(u) for u in workers]
        max_load, min_load = max(loads), min(loads)
        if (
            max_load - min_load > cfg.balance_abs_threshold
            and max_load > cfg.balance_rel_threshold * min_load
        ):
            return least_queued(workers, view)
        # The router's exact tree (`match`) is deliberately ignored: this policy routes on
        # what it remembers sending.
        own = self.tree.match(req.input_ids).per_worker
        alive = [u for u in workers if u in own]
        if alive:
            best_len = max(own[u] for u in alive)
            if best_len / req.input_len > cfg.cache_threshold:
                return least_queued([u for u in alive if own[u] == best_len], view)
        return least_queued(workers, view)

    def on_dispatched(
        self, req: Request, worker: int, match: GlobalMatch, view: RouterView
    ) -> None:
        self.tree.insert(req.input_ids, worker)

    def on_worker_removed(self, worker: int) -> None:
        self.tree.remove_worker(worker)
