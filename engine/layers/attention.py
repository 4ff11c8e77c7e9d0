"""The attention layer: hands q, k, v and this layer's cache to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from engine.runner.attention.metadata import ForwardContext


class Attention(nn.Module):
    """Paged attention for one decoder layer; the backend stores k, v before attending."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
        positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (T, Hq*D), k and v (T, Hkv*D) -> (T, Hq*D).

        With ``positions`` (T,) and ``cos_sin_cache`` (neox rotary table) q and k arrive
        un-rotated and the backend rotates them: a decode step's kernel rotates, stores and
        attends in one launch.
        """
        num_tokens = q.shape[0]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]  # (num_blocks, block_size, Hkv, D) each
        args = (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            k_cache, v_cache, ctx.attn, self.scale,
        )
        if positions is None:
            out = ctx.backend.forward(*args)  # (T, Hq, D)
        else:
            out = ctx.backend.forward_rotary(*args, positions, cos_sin_cache)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
