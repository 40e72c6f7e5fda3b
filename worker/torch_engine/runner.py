"""A scheduler + torch engine pair (``make_torch_worker``), as ``make_sim_worker`` for the sim.

The scheduler's KV cache runs ``exact``: every token's KV lives at the allocator's slot, so
the engine reads ``scheduler.kv_slots(req)`` for the flat slots of a request's positions.
Iteration costs for batch-selecting policies (BROS) still come from a cost model (the
``cost_model`` argument, default the simulator's H100 / Llama-3.1-8B).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from sgl_fair.policies.base import Policy
from sgl_fair.worker.kv.prefix_cache import PrefixKVCache
from sgl_fair.worker.kv.registry import make_allocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.torch_engine.engine import TorchEngine
from sgl_fair.worker.torch_engine.model import LlamaConfig, LlamaModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}  # fmt: skip


def exact_kv_supported() -> bool:
    """Whether this tree's scheduler exposes ``kv_slots`` (the exact KV cache)."""
    params = inspect.signature(PrefixKVCache).parameters
    return hasattr(Scheduler, "kv_slots") and "exact" in params


def load_model(
    name: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    seed: int = 0,
    vocab_size: int | None = None,
) -> LlamaModel:
    """``name``: a preset (``tiny``: random weights from ``seed``, its vocabulary sized to
    ``vocab_size`` when given) or a local Hugging Face Llama checkpoint directory."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if Path(name).is_dir():
        return LlamaModel.from_pretrained(name, dtype=dt, device=device)
    overrides = {"vocab_size": vocab_size} if vocab_size else {}
    cfg = LlamaConfig.preset(name, **overrides)
    return LlamaModel.random(cfg, seed=seed, dtype=dt, device=device)


def make_torch_worker(
    *,
    policy: Policy,
    model: LlamaModel,
    allocator: str = "token",
    kv_tokens: int = 4096,
    config: SchedulerConfig | None = None,
    allocator_opts: dict | None = None,
    attention: str = "reference",
    eos_token_id: int | None = None,
    vocab_limit: int | None = None,
    cost_model: CostModel | None = None,
) -> tuple[Scheduler, TorchEngine]:
    """A scheduler over an exact prefix cache and a ``TorchEngine`` whose KV pools are the
    allocator's slots (``kv_tokens`` of them; the bidirectional allocator's host slots too)."""
    if not exact_kv_supported():
        raise RuntimeError(
            "the torch engine needs Scheduler.kv_slots and PrefixKVCache(exact=True) (the exact "
            "KV cache), which this tree does not have yet"
        )
    alloc = make_allocator(allocator, kv_tokens, **(allocator_opts or {}))
    kv: Any = PrefixKVCache(alloc, exact=True)
    cost = cost_model or CostModel.from_names("H100-80GB", "Llama-3.1-8B")
    scheduler = Scheduler(policy=policy, kv=kv, config=config, cost=cost.step_time)
    block_size = int(getattr(alloc, "block_size", 1))
    host = getattr(alloc, "host_capacity_tokens", None)
    if host is None:
        host = alloc.capacity_tokens if getattr(alloc, "restore_plan", None) else 0
    engine = TorchEngine(
        model,
        kv_slots=scheduler.kv_slots,
        num_device_slots=alloc.capacity_tokens,
        block_size=block_size,
        host_slots=int(host),
        attention=attention,
        eos_token_id=eos_token_id,
        vocab_limit=vocab_limit,
    )
    return scheduler, engine
