"""A CPU rig around SGLang 0.5.23's real scheduler code: no GPU, no model, no processes.

``Rig`` holds a real ``RadixCache`` (``create_simulated`` over a real ``TokenToKVPoolAllocator``
on the CPU) and a ``Scheduler`` object made without ``__init__`` and given only the attributes
that ``Scheduler._get_new_batch_prefill_raw`` reads. ``Rig.admit()`` runs that real method —
``calc_priority``, the real ``PrefillAdder`` and its admission loop — and stops it where it
would build the GPU batch, returning the admitted requests in order.
"""

from __future__ import annotations

import itertools
from array import array
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.managers import scheduler as sched_mod
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

_published = False


def publish_server_args() -> None:
    """SGLang's admission code reads its runtime config bags; publish defaults once."""
    global _published
    if not _published:
        get_context().set_server_args(
            ServerArgs(model_path="dummy", device="cpu", pp_max_micro_batch_size=1 << 20)
        )
        _published = True


def unified_cache(alloc: Any, *, events: bool = True, page_size: int = 1) -> Any:
    """SGLang's ``UnifiedRadixCache`` over ``alloc``, with its Python tree core (the Rust one,
    the default, is not built here; both publish the same KV events)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        enable_kv_cache_events=events, tree_core_backend="python",
        tree_components=(ComponentType.FULL,),
    )  # fmt: skip
    return UnifiedRadixCache(params)


class _BatchBuilt(Exception):
    """Raised where the real method would build the GPU batch: admission is over."""

    def __init__(self, reqs: list[Req]) -> None:
        self.reqs = reqs


_rids = itertools.count()


def make_req(ids, client: str | None, max_new_tokens: int = 16, rid: str | None = None) -> Req:
    """SGLang's own ``Req``, as its tokenizer manager would hand it to the scheduler."""
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    rid = rid or f"req-{next(_rids)}"
    return Req(rid, "", array("q", ids), sp, routing_key=client)


class _Rows:
    """``req_to_token_pool``: only its free-row count is read during admission."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def available_size(self) -> int:
        return self.rows


class Rig:
    def __init__(
        self,
        *,
        kv_tokens: int = 100_000,
        chunked_prefill_size: int = 8192,
        max_prefill_tokens: int = 16384,
        max_running_requests: int = 4096,
        policy: str = "fcfs",
        cache: str = "radix",
    ) -> None:
        publish_server_args()
        self.alloc = TokenToKVPoolAllocator(kv_tokens, torch.float16, "cpu", None, False)
        if cache == "radix":
            self.tree = RadixCache.create_simulated(mock_allocator=self.alloc)
        else:  # "unified": SGLang's default server cache (Python tree core), KV events on
            self.tree = unified_cache(self.alloc)
        s = Scheduler.__new__(Scheduler)
        s.tree_cache = self.tree
        s.token_to_kv_pool_allocator = self.alloc
        s.req_to_token_pool = _Rows(max_running_requests)
        s.page_size = 1
        s.waiting_queue = []
        s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        s.chunked_req = None
        s.chunked_prefill_size = chunked_prefill_size
        s.max_prefill_tokens = max_prefill_tokens
        s.max_running_requests = max_running_requests
        s.max_prefill_bs = 0
        s.dynamic_chunk_sizer = None
        s.min_free_slots_delayer = None
        s.enable_priority_preemption = False
        s.is_hybrid_swa = False
        s.is_mixed_chunk = False
        s.enable_lora = False
        s.enable_hicache_storage = False
        s.enable_lmcache = False
        s.enable_hierarchical_cache = False
        s.truncation_align_size = None
        s.priority_scheduling_preemption_threshold = 10
        s.processed_tokens_counter = 0
        s.dllm_config = None
        s.new_token_ratio_tracker = SimpleNamespace(current=0.7)
        s.grammar_manager = SimpleNamespace(has_waiting_grammars=lambda: False)
        s.beam_coordinator = SimpleNamespace(pending_member_rows=lambda batch: 0)
        s.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=object()))
        s.model_config = s.spec_algorithm = None  # only passed on to the batch it would build
        s.enable_overlap = False
        s.policy = SchedulePolicy(policy, self.tree, False, False, False)
        self.scheduler = s

    # ---- state ----------------------------------------------------------------------------

    def cache(self, ids) -> None:
        """Put ``ids`` in the prefix cache (as a finished request would leave them)."""
        value = self.alloc.alloc(len(ids))
        self.tree.insert(InsertParams(key=RadixKey(token_ids=array("q", ids)), value=value))

    def queue(self, req: Req) -> None:
        self.scheduler.waiting_queue.append(req)

    # ---- the real admission -----------------------------------------------------------------

    def admit(self) -> list[Req]:
        """One run of ``Scheduler._get_new_batch_prefill_raw``: the admitted requests in order
        (the waiting queue keeps the rest, as SGLang leaves it)."""
        s = self.scheduler
        real_init_new = ScheduleBatch.init_new
        real_set_time = sched_mod.set_time_batch

        def stop(reqs, *args, **kwargs):
            raise _BatchBuilt(list(reqs))

        ScheduleBatch.init_new = stop  # type: ignore[method-assign]
        sched_mod.set_time_batch = lambda *a, **k: None
        try:
            batch, _running = Scheduler._get_new_batch_prefill_raw(s, None, s.running_batch)
        except _BatchBuilt as built:
            return built.reqs
        finally:
            ScheduleBatch.init_new = real_init_new  # type: ignore[method-assign]
            sched_mod.set_time_batch = real_set_time
        assert batch is None
        return []
