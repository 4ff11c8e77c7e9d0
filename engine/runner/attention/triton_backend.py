"""Attention through the Triton kernels over the paged cache (the GPU backend)."""

from __future__ import annotations

import torch

from engine.runner.attention.metadata import AttentionMetadata
from sluiceway_kernels.paged_decode_attention import paged_decode_attention
from sluiceway_kernels.paged_prefill_attention import paged_prefill_attention
from sluiceway_kernels.rope_decode_attention import rope_decode_attention
from sluiceway_kernels.rope_store import rope_store
from sluiceway_kernels.rotary import apply_rotary
from sluiceway_kernels.store_kvcache import store_kvcache


# NOTE: decode batches up to this size rotate, store the new K/V and attend in one launch
# (three before). On an H200 (llama3-8b, docs/BENCHMARKS.md) that saved 1.9-3.7 us per layer
# at batch 1 and 8; bigger batches keep the three launches, where launches cost little: the
# fused kernel holds more registers (162 against 96 a thread, sm_90), and with every decode
# step fused a throughput run's decode steps (batches up to 256) took 1.4% longer.
FUSED_DECODE_MAX_BATCH = 32


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
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        k_scale, v_scale = kv_scales or (None, None)
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self._attend(q, k_cache, v_cache, meta, scale, kv_scales, out)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (T, Hq, D), over a cache that holds the step's keys and values
        k_scale, v_scale = kv_scales or (None, None)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if meta.decode_only:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out=out,
                max_context_len=meta.max_context_len, **scales,
            )
        d = meta.num_decodes
        if d == 0:
            return paged_prefill_attention(
                q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables, scale,
                meta.max_query_len, out=out, **scales,
            )
        # NOTE: a mixed step's leading decodes go to the decode kernel, which reads their
        # contexts at full bandwidth; in the prefill kernel their query tiles are mostly empty.
        decodes, rest = meta.split()
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (T, Hq, D)
        paged_decode_attention(
            q[:d], k_cache, v_cache, decodes.block_tables, decodes.context_lens, scale,
            out=out[:d], max_context_len=meta.max_context_len, **scales,
        )
        paged_prefill_attention(
            q[d:], k_cache, v_cache, rest.query_start_loc, rest.context_lens, rest.block_tables,
            scale, meta.max_query_len, out=out[d:], **scales,
        )
        return out

    def forward_rotary(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (T, Hq, D): ``out`` when given
        k_scale, v_scale = kv_scales or (None, None)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if meta.decode_only and q.shape[0] <= FUSED_DECODE_MAX_BATCH:
            return rope_decode_attention(
                q, k, v, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.slot_mapping, positions,
                cos_sin_cache, scale, is_neox=True, out=out, max_context_len=meta.max_context_len, **scales,
            )
        if meta.decode_only:
            apply_rotary(q, k, positions, cos_sin_cache, is_neox=True)
            return self.forward(q, k, v, k_cache, v_cache, meta, scale, kv_scales, out)
        d = meta.num_decodes
        if not 0 < d <= FUSED_DECODE_MAX_BATCH:
            # NOTE: a prompt-carrying step rotates and stores in one launch a layer (two before):
            # its launches, not its arithmetic, bound it on the eager path
            rope_store(q, k, v, k_cache, v_cache, meta.slot_mapping, positions, cos_sin_cache, True, **scales)
            return self._attend(q, k_cache, v_cache, meta, scale, kv_scales, out)
        # NOTE: a mixed step's few leading decodes take the fused kernel too: the variant the
        # decode graphs compiled at start-up (the unfused split variant would compile mid-run).
        decodes, rest = meta.split()
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (T, Hq, D)
        rope_decode_attention(
            q[:d], k[:d], v[:d], k_cache, v_cache, decodes.block_tables, decodes.context_lens,
            decodes.slot_mapping, positions[:d], cos_sin_cache, scale, is_neox=True, out=out[:d],
            max_context_len=meta.max_context_len, **scales,
        )
        q = q[d:]
        rope_store(q, k[d:], v[d:], k_cache, v_cache, rest.slot_mapping, positions[d:], cos_sin_cache, True, **scales)
        paged_prefill_attention(
            q, k_cache, v_cache, rest.query_start_loc, rest.context_lens, rest.block_tables,
            scale, meta.max_query_len, out=out[d:], **scales,
        )
        return out
