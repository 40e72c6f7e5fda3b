"""Roofline cost model: how long one engine step takes for a (GPU, model, tp).

A step runs a batch of prefill chunks and decode tokens through the model once. It is priced as
three phases that run one after another on every GPU of the tensor-parallel group:

    linear  = max(linear FLOPs / achieved FLOP/s,    weight bytes / achieved bandwidth)
    attn    = max(attention FLOPs / achieved FLOP/s, KV bytes / achieved bandwidth)
    comm    = 2 all-reduces per layer (tp > 1 only): latency + ring traffic / link bandwidth
    step    = linear + attn + comm + step_overhead_s          (0 for an empty step)

Each phase takes its own roofline max because GEMMs and attention are separate kernels: a large
compute-bound prefill does not hide the KV reads of the decodes batched with it. Every count is
per GPU: weights, heads and FLOPs split tp ways; KV heads split too, but never below one per GPU.

Inputs: a prefill chunk is `(num_new_tokens, num_context_before)`; a decode is one new token over
`context_len` tokens of KV, i.e. exactly a chunk `(1, context_len)`. Cached prefix tokens enter
only through attention; each chunk or decode computes one row of logits (SGLang's logits
processor keeps the last position of every extend). See README.md for every number's source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .hardware import GiB, GPUSpec, ModelSpec, get_gpu, get_model

# Memory inside SGLang's static fraction that is neither weights nor KV (CUDA context and cuBLAS
# workspace, NCCL buffers, sampling buffers); an assumption, see README.md.
ACTIVATION_RESERVE_BYTES = 1 * GiB
# `from_names` picks tp so that weights, the reserve and MIN_KV_TOKENS of KV fit in this fraction.
FIT_MEM_FRACTION = 0.90
MIN_KV_TOKENS = 4096
MAX_TP = 8  # one node


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks a serving engine achieves; assumptions to calibrate on a GPU.

    flops: GEMM FLOP/s over peak (prefill MFU of the linear layers).
    bandwidth: achieved device-memory bandwidth over peak (decode MBU), for weights and KV alike.
    attention_flops: attention-kernel FLOP/s over peak (FlashInfer/FlashAttention prefill).
    step_overhead_s: fixed cost of a step (scheduling, launches, sampling) not hidden by the GPU.
    link_bandwidth: achieved all-reduce bus bandwidth over the link's peak (tp > 1 only).
    """

    flops: float
    bandwidth: float
    attention_flops: float
    step_overhead_s: float
    link_bandwidth: float = 0.8

    def __post_init__(self) -> None:
        for field in ("flops", "bandwidth", "attention_flops", "link_bandwidth"):
            value = getattr(self, field)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"Efficiency.{field} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0:
            raise ValueError(f"Efficiency.step_overhead_s must be >= 0, got {self.step_overhead_s}")


# Per-GPU defaults, keyed by canonical GPU name; README.md ("Efficiency factors") says why.
DEFAULT_EFFICIENCY: dict[str, Efficiency] = {
    "A10G-24GB": Efficiency(
        flops=0.60,
        bandwidth=0.85,
        attention_flops=0.45,
        step_overhead_s=1.5e-3,
        link_bandwidth=0.6,
    ),
    "A100-80GB": Efficiency(
        flops=0.65, bandwidth=0.80, attention_flops=0.50, step_overhead_s=1.5e-3
    ),
    # The same SXM4 die and kernels as the 80 GB part; only its HBM (peak) is slower.
    "A100-40GB": Efficiency(
        flops=0.65, bandwidth=0.80, attention_flops=0.50, step_overhead_s=1.5e-3
    ),
    "H100-80GB": Efficiency(
        flops=0.60, bandwidth=0.80, attention_flops=0.45, step_overhead_s=1.5e-3
    ),
    "H200": Efficiency(flops=0.60, bandwidth=0.80, attention_flops=0.45, step_overhead_s=1.5e-3),
}
# For a GPUSpec outside the table: deliberately conservative.
GENERIC_EFFICIENCY = Efficiency(
    flops=0.5, bandwidth=0.75, attention_flops=0.4, step_overhead_s=2e-3
)


def default_efficiency(gpu: GPUSpec) -> Efficiency:
    return DEFAULT_EFFICIENCY.get(gpu.name, GENERIC_EFFICIENCY)


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int) -> int:
    """K and V of one token, all layers, on one GPU; KV heads are replicated when tp > num_kv."""
    kv_heads_per_gpu = -(-model.num_kv_heads // tp)
    return 2 * model.num_layers * kv_heads_per_gpu * model.head_dim * model.dtype_bytes


def kv_capacity_tokens_for(
    gpu: GPUSpec, model: ModelSpec, tp: int, mem_fraction_static: float = 0.88
) -> int:
    """KV pool size like SGLang's: per GPU, static memory - weights - reserve, over KV/token."""
    free_bytes = (
        gpu.mem_bytes * mem_fraction_static - model.weight_bytes / tp - ACTIVATION_RESERVE_BYTES
    )
    return max(0, int(free_bytes // kv_bytes_per_token_per_gpu(model, tp)))


def fits(gpu: GPUSpec, model: ModelSpec, tp: int) -> bool:
    """Weights, reserve and MIN_KV_TOKENS of KV fit in FIT_MEM_FRACTION of each GPU's memory."""
    return kv_capacity_tokens_for(gpu, model, tp, FIT_MEM_FRACTION) >= MIN_KV_TOKENS


def min_tp(gpu: GPUSpec, model: ModelSpec) -> int | None:
    """The smallest power-of-two tp (up to MAX_TP) at which `model` fits on `gpu`, else None."""
    tp = 1
    while tp <= MAX_TP:
        if model.num_heads % tp == 0 and fits(gpu, model, tp):
            return tp
        tp *= 2
    return None


def _check_tp(gpu: GPUSpec, model: ModelSpec, tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if model.num_heads % tp:
        raise ValueError(f"tp={tp} does not divide {model.name}'s {model.num_heads} heads")
    if fits(gpu, model, tp):
        return
    need = model.weight_bytes / tp + ACTIVATION_RESERVE_BYTES
    need += MIN_KV_TOKENS * kv_bytes_per_token_per_gpu(model, tp)
    smallest = min_tp(gpu, model)
    hint = f"use tp={smallest}" if smallest else f"no tp up to {MAX_TP} fits"
    raise ValueError(
        f"{model.name} does not fit on {gpu.name} with tp={tp}: needs {need / GiB:.1f} GiB per GPU "
        f"(weights, {ACTIVATION_RESERVE_BYTES / GiB:.0f} GiB reserve, {MIN_KV_TOKENS} KV tokens), "
        f"more than {FIT_MEM_FRACTION:.0%} of {gpu.mem_bytes / GiB:.1f} GiB; {hint}"
    )


# Host -> device copy rate for swapped-in KV (PCIe Gen4 x16, effective; BROS checkpoints).
HOST_TO_DEVICE_BYTES_PER_S = 25e9


class CostModel:
    """Step durations for one (GPU, model, tp). Pure and cheap: plain float math per call."""

    def __init__(
        self,
        gpu: GPUSpec,
        model: ModelSpec,
        *,
        tp: int = 1,
        efficiency: Efficiency | None = None,
    ) -> None:
        _check_tp(gpu, model, tp)
        self.gpu = gpu
        self.model = model
        self.tp = tp
        self.efficiency = efficiency if efficiency is not None else default_efficiency(gpu)
        eff = self.efficiency

        # Everything below is seconds per unit on one GPU of the group, fixed at construction.
        flop_rate = eff.flops * gpu.peak_flops * tp  # linear FLOPs split evenly over the group
        attn_rate = eff.attention_flops * gpu.peak_flops * tp  # heads split over the group
        byte_rate = eff.bandwidth * gpu.mem_bw  # per GPU, for per-GPU bytes
        self._weights_s = model.weight_bytes / tp / byte_rate
        self._per_token_s = 2 * model.num_nonembedding_params / flop_rate
        self._per_logit_row_s = 2 * model.num_lm_head_params / flop_rate
        # Causal attention: QK^T and PV are 2 FLOPs each per (query, key, q-dim) per layer.
        self._per_attn_pair_s = 4 * model.num_layers * model.q_size / attn_rate
        self._per_kv_token_s = kv_bytes_per_token_per_gpu(model, tp) / byte_rate
        if tp > 1:
            num_allreduces = 2 * model.num_layers  # after attention and after the MLP
            ring_bytes = 2 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes
            link_rate = eff.link_bandwidth * gpu.link_bw
            self._comm_fixed_s = num_allreduces * gpu.allreduce_latency_s
            self._comm_per_token_s = num_allreduces * ring_bytes / link_rate
        else:
            self._comm_fixed_s = 0.0
            self._comm_per_token_s = 0.0

    @classmethod
    def from_names(
        cls, gpu: str, model: str, tp: int | None = None, *, efficiency: Efficiency | None = None
    ) -> CostModel:
        """Look up specs by name; tp=None picks the smallest power of two that fits."""
        gpu_spec, model_spec = get_gpu(gpu), get_model(model)
        if tp is None:
            tp = min_tp(gpu_spec, model_spec)
            if tp is None:
                raise ValueError(
                    f"{model_spec.name} does not fit on {gpu_spec.name} with any tp up to {MAX_TP}"
                )
        return cls(gpu_spec, model_spec, tp=tp, efficiency=efficiency)

    # ---- memory ---------------------------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        """All weights, summed over the TP group."""
        return self.model.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers, summed over the TP group (without replication)."""
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return kv_bytes_per_token_per_gpu(self.model, self.tp)

    def kv_capacity_tokens(self, mem_fraction_static: float = 0.88) -> int:
        """Tokens the KV pool holds (each token's KV is spread over the whole TP group)."""
        return kv_capacity_tokens_for(self.gpu, self.model, self.tp, mem_fraction_static)

    # ---- time -----------------------------------------------------------------------------

    def step_time(
        self,
        *,
        prefill_chunks: Sequence[tuple[int, int]] = (),
        decode_context_lens: Sequence[int] = (),
        swap_in_tokens: int = 0,
    ) -> float:
        """Seconds for one step running `prefill_chunks` and one token per decode; 0 if empty.

        A chunk `(num_new_tokens, num_context_before)` computes num_new_tokens tokens over that
        many tokens of existing KV; a chunk with no new tokens does nothing. Lengths must be >= 0.
        `swap_in_tokens` of checkpointed KV copied host -> device overlap the step (SPEC §5:
        max'ed, not added) at `HOST_TO_DEVICE_BYTES_PER_S`.
        """
        compute_s = self._compute_time(prefill_chunks, decode_context_lens)
        if swap_in_tokens <= 0:
            return compute_s
        swap_s = swap_in_tokens * self.kv_bytes_per_token_per_gpu / HOST_TO_DEVICE_BYTES_PER_S
        return max(compute_s, swap_s)

    def _compute_time(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]
    ) -> float:
        num_tokens = 0
        num_logit_rows = 0
        attn_pairs = 0.0  # (query, key) pairs, causal
        kv_tokens = 0  # tokens of KV read or written
        for num_new, num_context in prefill_chunks:
            if num_new <= 0:
                continue
            num_tokens += num_new
            num_logit_rows += 1
            attn_pairs += num_new * (num_context + 0.5 * num_new)
            kv_tokens += num_context + num_new
        num_decodes = len(decode_context_lens)
        if num_decodes:
            context_sum = sum(decode_context_lens)
            num_tokens += num_decodes
            num_logit_rows += num_decodes
            attn_pairs += context_sum + 0.5 * num_decodes  # the chunk (1, context_len)
            kv_tokens += context_sum + num_decodes
        if num_tokens == 0:
            return 0.0
        linear_s = max(
            num_tokens * self._per_token_s + num_logit_rows * self._per_logit_row_s,
            self._weights_s,
        )
        attn_s = max(attn_pairs * self._per_attn_pair_s, kv_tokens * self._per_kv_token_s)
        comm_s = self._comm_fixed_s + num_tokens * self._comm_per_token_s
        return linear_s + attn_s + comm_s + self.efficiency.step_overhead_s

    def prefill_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One batched prefill step; see `step_time`."""
        return self.step_time(prefill_chunks=chunks)

    def decode_time(self, context_lens: Sequence[int]) -> float:
        """One decode step: one token for each request, each reading context_lens[i] KV tokens."""
        return self.step_time(decode_context_lens=context_lens)

    # ---- reports --------------------------------------------------------------------------

    def describe(self) -> dict:
        return {
            "gpu": self.gpu.name,
            "model": self.model.name,
            "hf_id": self.model.hf_id,
            "tp": self.tp,
            "efficiency": dataclasses.asdict(self.efficiency),
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity_tokens(),
        }

    def __repr__(self) -> str:
        return f"CostModel({self.gpu.name}, {self.model.name}, tp={self.tp})"
