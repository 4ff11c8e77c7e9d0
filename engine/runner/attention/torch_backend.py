"""Attention in plain torch over the paged cache: the CPU backend and the reference."""

from __future__ import annotations

import torch

from engine.runner.attention.metadata import AttentionMetadata
from sluiceway_kernels.paged_decode_attention import paged_decode_attention_ref
from sluiceway_kernels.paged_prefill_attention import paged_prefill_attention_ref
from sluiceway_kernels.rotary import apply_rotary_ref
from sluiceway_kernels.store_kvcache import store_kvcache_ref


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        k_scale, v_scale = kv_scales or (None, None)
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.decode_only:
            return paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                              k_scale=k_scale, v_scale=v_scale)
        return paged_prefill_attention_ref(
            q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables, scale,
            meta.max_query_len, k_scale=k_scale, v_scale=v_scale,
        )

    def forward_rotary(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (T, Hq, D): ``out`` when given
        apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox=True)
        result = self.forward(q, k, v, k_cache, v_cache, meta, scale, kv_scales)
        return result if out is None else out.copy_(result)
