"""A Llama-architecture decoder in plain torch: the real engine's model.

Embedding, ``num_layers`` x (RMSNorm, q/k/v projections with grouped-query attention, RoPE in
Hugging Face's "rotate_half" convention, attention, o_proj, residual, RMSNorm, SwiGLU MLP,
residual), final RMSNorm, ``lm_head`` (optionally tied to the embedding). Weight names follow
Hugging Face's ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight`` ...), so a
local checkpoint directory (``config.json`` + ``*.safetensors``) loads as is.

The layer is split where the KV cache goes in (``LlamaLayer.qkv`` / ``LlamaLayer.finish``): the
engine writes K/V into its pools and runs paged attention in between. ``forward_full`` is the
naive reference: the whole sequence, no cache, dense causal attention.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

PRESETS: dict[str, dict[str, Any]] = {
    # 2 layers, hidden 256, 4 heads of 64, 2 KV heads: ~17 M parameters, mostly the embeddings
    "tiny": dict(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        max_position=8192,
    ),
}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    max_position: int = 8192
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Hugging Face's rope_scaling (Llama 3.1's {"rope_type": "llama3", ...}); None: plain RoPE
    rope_scaling: dict[str, Any] | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not split into {self.num_kv_heads} groups")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` (LlamaForCausalLM and look-alikes)."""
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=cfg.get("rope_scaling"),
            eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """float64 inverse frequencies ``[head_dim / 2]``, with Llama 3's scaling if configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(between, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        attn.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        attn.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        attn.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.mlp = mlp

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, hidden]`` -> q ``[T, H, D]``, k, v ``[T, Hkv, D]`` (RoPE applied to q, k)."""
        a = self.self_attn
        h = self.input_layernorm(x)
        t = x.shape[0]
        q = a.q_proj(h).view(t, self.num_heads, self.head_dim)
        k = a.k_proj(h).view(t, self.num_kv_heads, self.head_dim)
        v = a.v_proj(h).view(t, self.num_kv_heads, self.head_dim)
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention output ``attn [T, H, D]`` and the MLP."""
        x = x + self.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        m = self.mlp
        h = self.post_attention_layernorm(x)
        return x + m.down_proj(nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


class LlamaModel(nn.Module):
    """``LlamaForCausalLM``'s weights under its names (``model.*``, ``lm_head``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        body = nn.Module()
        body.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        body.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_layers))
        body.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.model = body
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = body.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def random(
        cls, cfg: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> LlamaModel:
        """Random weights from ``seed``: projections N(0, 0.02), embeddings N(0, 1), and an
        ``lm_head`` scaled so logits have a spread of a few units (a peaked, not flat,
        next-token distribution: greedy choices are well separated)."""
        with torch.device("cpu"):
            model = cls(cfg)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                elif name == "model.embed_tokens.weight":
                    p.normal_(0.0, 1.0, generator=g)
                elif name == "lm_head.weight":
                    p.normal_(0.0, 3.0 / math.sqrt(cfg.hidden_size), generator=g)
                else:
                    p.normal_(0.0, 0.02, generator=g)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype | None = None, device="cpu"
    ) -> LlamaModel:
        """A local Hugging Face Llama checkpoint: ``config.json`` and ``*.safetensors``."""
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ValueError(f"{root}: no config.json (a local Hugging Face model directory)")
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(
                "loading a checkpoint needs the 'safetensors' package "
                "(pip install safetensors, or pip install -e '.[kernels]')"
            ) from e
        hf = json.loads((root / "config.json").read_text())
        cfg = LlamaConfig.from_hf(hf)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{root}: no *.safetensors weights")
        with torch.device("meta"):
            model = cls(cfg)
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        state.pop("model.rotary_emb.inv_freq", None)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        want = {
            k
            for k in model.state_dict()
            if not k.startswith("lm_head") or not cfg.tie_word_embeddings
        }
        missing, extra = sorted(want - state.keys()), sorted(state.keys() - want)
        if missing or extra:
            raise ValueError(
                f"{root}: weights do not fit: missing {missing[:4]}, extra {extra[:4]}"
            )
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg)
        target = dtype or next(iter(state.values())).dtype
        return model.to(device=device, dtype=target).eval().requires_grad_(False)

    # ---- computing --------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` for integer ``positions [T]`` (computed in float64)."""
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq.to(torch.float64)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` -> float32 (or float64) logits ``[N, vocab]``."""
        out = self.lm_head(self.model.norm(x))
        return out if out.dtype == torch.float64 else out.float()

    @torch.no_grad()
    def forward_full(self, token_ids) -> torch.Tensor:
        """The naive reference: logits ``[n, vocab]`` of a whole sequence, no cache (dense
        causal attention over positions 0..n-1)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)
        n = ids.shape[0]
        cos, sin = self.rope(torch.arange(n, device=self.device))
        x = self.embed(ids)
        mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        for layer in self.layers:
            q, k, v = layer.qkv(x, cos, sin)
            x = layer.finish(x, dense_attention(q, k, v, mask))
        return self.logits(x)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``q [M, H, D]``, ``k, v [N, Hkv, D]`` (GQA), ``mask [M, N]`` (True: visible) ->
    ``[M, H, D]``; the softmax in float32 for half dtypes, else in q's dtype."""
    group = q.shape[1] // k.shape[1]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", qf, kf) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hmn,nhd->mhd", probs, vf).to(q.dtype)
