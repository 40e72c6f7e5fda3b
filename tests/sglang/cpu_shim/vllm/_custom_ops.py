"""CPU TEST SHIM: ``vllm._custom_ops.rotary_embedding`` in plain torch.

Off CUDA (and without SGLang's CPU engine, which needs ``sgl_kernel``), SGLang 0.5.23's
``RotaryEmbedding`` (``layers/rotary_embedding/base.py``) takes its fallback kernel from
``vllm._custom_ops``. This is that op's contract: rotate ``query`` and ``key`` in place,
``[num_tokens, heads * head_size]`` (or ``[num_tokens, heads, head_size]``), by the rows of
``cos_sin_cache`` (``[max_position, rot_dim]``, cos then sin) at ``positions``; GPT-NeoX
style rotates the two halves of the rotary dims, GPT-J style the even/odd pairs.
"""

from __future__ import annotations

import torch


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    cos_sin = cos_sin_cache.index_select(0, positions.flatten().long())
    cos, sin = cos_sin.chunk(2, dim=-1)
    for x in (query, key):
        if x is not None:
            _rotate_(x, cos, sin, head_size, is_neox)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, neox: bool):
    n = cos.shape[0]
    heads = x.view(n, -1, head_size)
    rot_dim = cos.shape[-1] * 2
    rot = heads[..., :rot_dim].float()
    c = cos.float().unsqueeze(1)
    s = sin.float().unsqueeze(1)
    if neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    heads[..., :rot_dim] = out.to(x.dtype)
