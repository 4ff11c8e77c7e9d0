"""Attention through the Triton kernels over the paged cache (the GPU backend)."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.store_kvcache import store_kvcache


class TritonAttentionBackend:
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                max_context_len=meta.max_context_len,
            )
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables, scale,
            meta.max_query_len,
        )
