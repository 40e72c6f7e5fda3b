"""Hardware and model specs for the simulated engine: datasheet peaks and published architectures.

Every number here is a published fact (vendor datasheet, `nvidia-smi`, or the model's Hugging Face
`config.json`); what a real engine *achieves* of these peaks lives in `cost_model.Efficiency`.
`worker/sim/README.md` gives the source of each number.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's datasheet peaks.

    `peak_flops` is dense (no 2:4 sparsity) fp16/bf16 tensor-core FLOP/s; `mem_bw` is peak device
    memory bandwidth in bytes/s; `mem_bytes` is the total memory a process sees (what `nvidia-smi`
    and `torch.cuda.mem_get_info` report, ECC on), which is what SGLang sizes its KV pool from.
    `link_bw` is the per-GPU, per-direction bandwidth of the link tensor-parallel all-reduces use
    (NVLink, or PCIe where there is none) and `allreduce_latency_s` the fixed cost of one small
    all-reduce over it.
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: int
    link_bw: float
    allreduce_latency_s: float


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as in its config.json: by default the Llama family (GQA
    attention, gated MLP, RMSNorm, rotary positions, no biases); OPT sets `gated_mlp=False`
    (fc1/fc2 with ReLU), `linear_bias` and `norm_bias` (LayerNorm) and `num_positions` (a learned
    position table: 2048 + OPT's offset of 2 rows).

    `num_params` is the published total; `num_params_from_architecture()` recomputes it from the
    shape, and a test keeps the two equal, so a typo in either shows up.
    """

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    context_len: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2
    gated_mlp: bool = True  # gate, up and down projections (SwiGLU); False: fc1, fc2
    linear_bias: bool = False  # every projection has a bias (OPT)
    norm_bias: bool = False  # LayerNorm (weight and bias) rather than RMSNorm (weight only)
    num_positions: int = 0  # rows of a learned position-embedding table (0: rotary)

    @property
    def q_size(self) -> int:
        """Width of all query heads together (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_bias else 1)

    @property
    def num_layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, the MLP (gated: gate, up,
        down; else fc1, fc2), biases where the model has them, two norms."""
        h, kv, ffn = self.hidden_size, self.num_kv_heads * self.head_dim, self.intermediate_size
        attention = h * self.q_size + 2 * h * kv + self.q_size * h
        mlp = (3 if self.gated_mlp else 2) * h * ffn
        if self.linear_bias:
            attention += self.q_size + 2 * kv + h
            mlp += (2 if self.gated_mlp else 1) * ffn + h
        return attention + mlp + 2 * self._norm_params

    @property
    def num_nonembedding_params(self) -> int:
        """Parameters every token goes through: all decoder layers and the final norm."""
        return self.num_layers * self.num_layer_params + self._norm_params

    @property
    def num_lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params_from_architecture(self) -> int:
        num_embedding_tables = 1 if self.tie_word_embeddings else 2
        embeddings = num_embedding_tables * self.num_lm_head_params
        return self.num_nonembedding_params + embeddings + self.num_positions * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes


# Datasheet numbers; see README.md ("GPUs") for each source.
GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        # GA102, PCIe, GDDR6, 150 W. No NVLink: TP all-reduces cross PCIe Gen4 x16.
        GPUSpec(
            name="A10G-24GB",
            peak_flops=125e12,
            mem_bw=600e9,
            mem_bytes=23028 * MiB,
            link_bw=32e9,
            allreduce_latency_s=25e-6,
        ),
        # SXM4, HBM2e, NVLink 3 (600 GB/s total = 300 GB/s per direction).
        GPUSpec(
            name="A100-80GB",
            peak_flops=312e12,
            mem_bw=2.039e12,
            mem_bytes=81920 * MiB,
            link_bw=300e9,
            allreduce_latency_s=8e-6,
        ),
        # SXM4 40GB (the BROS paper's OPT testbed), HBM2, NVLink 3 (600 GB/s total).
        GPUSpec(
            name="A100-40GB",
            peak_flops=312e12,
            mem_bw=1.555e12,
            mem_bytes=40960 * MiB,
            link_bw=300e9,
            allreduce_latency_s=8e-6,
        ),
        # SXM5, HBM3, NVLink 4 (900 GB/s total = 450 GB/s per direction).
        GPUSpec(
            name="H100-80GB",
            peak_flops=989e12,
            mem_bw=3.35e12,
            mem_bytes=81559 * MiB,
            link_bw=450e9,
            allreduce_latency_s=8e-6,
        ),
        # SXM, HBM3e; same Hopper compute as the H100 SXM.
        GPUSpec(
            name="H200",
            peak_flops=989e12,
            mem_bw=4.8e12,
            mem_bytes=143771 * MiB,
            link_bw=450e9,
            allreduce_latency_s=8e-6,
        ),
    )
}

_GPU_ALIASES: dict[str, str] = {
    "a10g": "A10G-24GB",
    "a100": "A100-80GB",
    "a100-80g": "A100-80GB",
    "a100-40g": "A100-40GB",
    "h100": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "h200-141gb": "H200",
}

# Architectures from each model's config.json; num_params is the published parameter count.
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="Llama-2-7B",
            hf_id="meta-llama/Llama-2-7b-hf",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            intermediate_size=11008,
            vocab_size=32000,
            num_params=6_738_415_616,
            context_len=4096,
        ),
        ModelSpec(
            name="Llama-3.2-3B",
            hf_id="meta-llama/Llama-3.2-3B-Instruct",
            num_layers=28,
            hidden_size=3072,
            num_heads=24,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=8192,
            vocab_size=128256,
            num_params=3_212_749_824,
            context_len=131072,
            tie_word_embeddings=True,
        ),
        ModelSpec(
            name="Llama-3.1-8B",
            hf_id="meta-llama/Llama-3.1-8B-Instruct",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            num_params=8_030_261_248,
            context_len=131072,
        ),
        # v0.2 has the v0.1 shapes without the 4096-token sliding window (full attention).
        ModelSpec(
            name="Mistral-7B",
            hf_id="mistralai/Mistral-7B-Instruct-v0.2",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=32000,
            num_params=7_241_732_096,
            context_len=32768,
        ),
        ModelSpec(
            name="Llama-3-70B",
            hf_id="meta-llama/Meta-Llama-3-70B-Instruct",
            num_layers=80,
            hidden_size=8192,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            num_params=70_553_706_496,
            context_len=8192,
        ),
        # The BROS paper's bidirectional-cache model (its §7.4). Full multi-head attention (56
        # KV heads); lm_head tied to the token embedding; 2048 positions + OPT's offset of 2.
        # `num_params` is computed from this shape: Meta publishes only "30B" (README).
        ModelSpec(
            name="OPT-30B",
            hf_id="facebook/opt-30b",
            num_layers=48,
            hidden_size=7168,
            num_heads=56,
            num_kv_heads=56,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=50272,
            num_params=29_974_540_288,
            context_len=2048,
            tie_word_embeddings=True,
            gated_mlp=False,
            linear_bias=True,
            norm_bias=True,
            num_positions=2050,
        ),
    )
}

_MODEL_ALIASES: dict[str, str] = {
    **{spec.hf_id.lower(): spec.name for spec in MODELS.values()},
    **{spec.hf_id.lower().split("/")[-1]: spec.name for spec in MODELS.values()},
    "llama-3.1-8b-instruct": "Llama-3.1-8B",
    "llama-3.2-3b-instruct": "Llama-3.2-3B",
    "mistral-7b-v0.1": "Mistral-7B",
    "meta-llama-3-70b": "Llama-3-70B",
}


def _lookup(kind: str, name: str, table: dict, aliases: dict[str, str]):
    key = name.strip().lower()
    canonical = {k.lower(): k for k in table}
    if key in canonical:
        return table[canonical[key]]
    if key in aliases:
        return table[aliases[key]]
    raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(table)}")


def get_gpu(name: str) -> GPUSpec:
    """The GPU named `name` (canonical or alias, any case); ValueError naming the choices."""
    return _lookup("GPU", name, GPUS, _GPU_ALIASES)


def get_model(name: str) -> ModelSpec:
    """The model named `name` (canonical, alias or HF id; any case); ValueError lists choices."""
    return _lookup("model", name, MODELS, _MODEL_ALIASES)
