"""The torch engine's kind in the worker builder (``TorchEngineKind``) and its scheduler +
engine pair (``make_torch_worker``), as ``make_sim_worker`` for the sim.

The scheduler's KV cache runs ``exact``: every token's KV lives at the allocator's slot, so
the engine reads ``scheduler.kv_slots(req)`` for the flat slots of a request's positions.
Iteration costs for batch-selecting policies (BROS) still come from a cost model (the
``cost_model`` argument, default the simulator's H100 / Llama-3.1-8B).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_fair.policies.base import Policy
from sgl_fair.worker.builder import build_worker
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.torch_engine.engine import TorchEngine
from sgl_fair.worker.torch_engine.model import LlamaConfig, LlamaModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}  # fmt: skip
DEFAULT_KV_TOKENS = 4096


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
    kv_tokens: int = DEFAULT_KV_TOKENS,
    config: SchedulerConfig | None = None,
    allocator_opts: dict | None = None,
    attention: str = "reference",
    eos_token_id: int | None = None,
    vocab_limit: int | None = None,
    cost_model: CostModel | None = None,
) -> tuple[Scheduler, TorchEngine]:
    """A scheduler over an exact prefix cache and a ``TorchEngine`` whose KV pools are the
    allocator's slots (``kv_tokens`` of them; the bidirectional allocator's host slots too):
    ``worker.builder.build_worker`` with the ``torch`` engine."""
    scheduler, engine = build_worker(
        policy=policy,
        engine="torch",
        engine_opts={
            "model": model,
            "attention": attention,
            "eos_token_id": eos_token_id,
            "vocab_limit": vocab_limit,
        },
        cost_model=cost_model,
        kv_tokens=kv_tokens,
        allocator=allocator,
        allocator_opts=allocator_opts,
        config=config,
    )
    assert isinstance(engine, TorchEngine)
    return scheduler, engine


# A live worker's KV pool when its config gives none (``worker.live``).
LIVE_DEFAULT_KV_TOKENS = 16384


class TorchEngineKind:
    """The torch engine in the worker builder's registry (``worker.builder``): an exact KV
    cache whose slots are the engine's KV pools; iteration costs for batch-selecting
    policies (BROS) from a cost model, by default the simulator's H100 / Llama-3.1-8B."""

    @dataclass(frozen=True)
    class Config:
        model: LlamaModel | None = None
        attention: str = "reference"
        eos_token_id: int | None = None
        vocab_limit: int | None = None

    exact_kv = True
    synchronous = True  # run() returns after the step: its duration has already elapsed

    def default_cost_model(self) -> CostModel:
        return CostModel.from_names("H100-80GB", "Llama-3.1-8B")

    def default_kv_tokens(self, cost_model: CostModel) -> int:
        return DEFAULT_KV_TOKENS

    def make_engine(
        self, config: Config, scheduler: Scheduler, allocator: Any, cost_model: CostModel
    ) -> TorchEngine:
        if config.model is None:
            raise ValueError("the torch engine needs a model (engine_opts model=)")
        caps = scheduler.kv.caps  # the allocator's declared capabilities (worker/kv/base.py)
        return TorchEngine(
            config.model,
            kv_slots=scheduler.kv_slots,
            num_device_slots=allocator.capacity_tokens,
            block_size=caps.block_size,
            host_slots=caps.host_capacity_tokens,
            attention=config.attention,
            eos_token_id=config.eos_token_id,
            vocab_limit=config.vocab_limit,
        )

    def live_parts(self, cfg: Any) -> dict[str, Any]:
        """``build_worker`` arguments for a live worker's config (``worker.live``): loads the
        model (``cfg.model``: a preset or a checkpoint directory) on ``cfg.torch_device``."""
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        model = load_model(
            cfg.model, dtype=cfg.torch_dtype, device=cfg.torch_device, vocab_size=cfg.vocab_size
        )
        return {
            "kv_tokens": cfg.kv_tokens or LIVE_DEFAULT_KV_TOKENS,
            "engine_opts": {
                "model": model,
                "attention": cfg.torch_attention,
                "eos_token_id": cfg.eos_token_id,
                "vocab_limit": cfg.vocab_size,
            },
        }

    def describe(self, cfg: Any) -> str:
        """What the worker says it runs (its Hello: ``/server_info``, the launcher's banner);
        a batch-selecting policy (BROS) prices its batches by the simulator's cost table,
        not by this engine's measured steps, and it says which."""
        from sgl_fair.policies.base import PolicyTraits, policy_class

        out = f"torch {cfg.model} ({cfg.torch_attention}, {cfg.torch_dtype})"
        if PolicyTraits.of(policy_class(cfg.policy)).batch_selecting:
            cm = self.default_cost_model()
            out += f"; {cfg.policy} prices batches by the simulated {cm.gpu.name} {cm.model.name}"
        return out

    def context_len(self, parts: Mapping[str, Any]) -> int | None:
        return parts["engine_opts"]["model"].config.max_position
