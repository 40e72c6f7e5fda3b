"""``Router.follow_kv`` (each op by handle, as the decoder reads it) leaves the router exactly
as ``apply_kv_ops(decoder.apply(batch))`` (each op by its whole path): the same claims per
worker, the same counts, the same eviction stamps — with two workers, the tree's own trim
(``max_tree_tokens``) and a worker removed and added back mid-stream."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.kv_events import EventBatch
from sgl_fair.router import Router, make_router_policy

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))
from test_kv_decoder_diff import streams  # noqa: E402
from test_kv_follow import _owned  # noqa: E402


def _state(router: Router) -> tuple:
    stats = {
        u: (s.num_kv_events, s.num_evicted_blocks, s.num_evicted_tokens, s.num_stale)
        for u, s in sorted(router.stats.items())
    }
    owned = {u: _owned(router.tree.tree, u) for u in (0, 1)}
    return stats, owned, dict(router._evicted_s), router.tree.total_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), streams(), st.integers(0, 8), st.sampled_from([None, 6, 40]))
def test_follow_kv_is_apply_kv_ops(a, b, revive_at, bound):
    by_path = Router(make_router_policy("rr"), 2, max_tree_tokens=bound)
    by_handle = Router(make_router_policy("rr"), 2, max_tree_tokens=bound)
    decs = {u: (KVEventDecoder(), KVEventDecoder()) for u in (0, 1)}
    for step in range(max(len(a), len(b))):
        if step == revive_at:
            for r in (by_path, by_handle):
                r.remove_worker(1)
        if step == revive_at + 2:
            for r in (by_path, by_handle):
                r.add_worker(1)
        for u, batches in ((0, a), (1, b)):
            if step < len(batches):
                batch = EventBatch(ts=float(step), events=batches[step])
                by_path.apply_kv_ops(u, decs[u][0].apply(batch), float(step))
                by_handle.follow_kv(u, decs[u][1], batch, float(step))
        if bound is None:  # a trim drops least recently used leaves: touches differ by design
            assert _state(by_handle) == _state(by_path), step
        by_handle.check_invariants()
