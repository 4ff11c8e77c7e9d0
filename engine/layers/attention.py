"""The attention layer: hands q, k, v and this layer's cache to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from engine.runner.attention.metadata import ForwardContext


class Attention(nn.Module):
    """Paged attention for one decoder layer; the backend stores k, v before attending.

    A float8 cache may hold this layer's keys and values divided by per-layer scales read
    from the checkpoint (``set_kv_scales``); without them the scale is 1.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # NOTE: device tensors the kernels read, so captured CUDA graphs see them; one value per
        # layer (not per head), so every tensor-parallel rank holds the same two.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.kv_scaled = False  # whether the kernels get the scales (only a float8 cache has them)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """This layer's float8 cache holds K / k_scale and V / v_scale."""
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)
        self.kv_scaled = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
        positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (T, Hq*D), k and v (T, Hkv*D) -> (T, Hq*D).

        With ``positions`` (T,) and ``cos_sin_cache`` (neox rotary table) q and k arrive
        un-rotated and the backend rotates them: a decode step's kernel rotates, stores and
        attends in one launch; ``out`` (T, Hq*D), contiguous in D, then receives the result.
        """
        num_tokens = q.shape[0]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]  # (num_blocks, block_size, Hkv, D) each
        args = (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            k_cache, v_cache, ctx.attn, self.scale,
        )
        kv_scales = (self.k_scale, self.v_scale) if self.kv_scaled else None
        if positions is None:
            result = ctx.backend.forward(*args, kv_scales=kv_scales)  # (T, Hq, D)
        else:
            heads = None if out is None else out.view(num_tokens, self.num_heads, self.head_dim)
            result = ctx.backend.forward_rotary(*args, positions, cos_sin_cache, kv_scales=kv_scales, out=heads)
        return result.reshape(num_tokens, self.num_heads * self.head_dim)
