"""Decode attention that first rotates the new token's query and key, stores its key and
value into the paged cache and attends, all in the one launch of the decode kernel."""

from __future__ import annotations

import torch

from sluiceway_kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check_kv_scales, check_same_device, check_shape, check_tensor
from sluiceway_kernels.paged_decode_attention import _check_decode, launch_decode, paged_decode_attention_ref
from sluiceway_kernels.rotary import apply_rotary_ref
from sluiceway_kernels.store_kvcache import store_kvcache_ref


def rope_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    scale: float,
    is_neox: bool = True,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``apply_rotary`` + ``store_kvcache`` + ``paged_decode_attention`` for one new token per
    sequence, in one kernel.

    Args:
        q: (B, Hq, D) un-rotated queries; k, v: (B, Hkv, D) the new token's un-rotated key and
            its value, q's dtype. Token and head dims may be strided (views of a fused qkv
            output), D contiguous. q and k are left as they are (not rotated in place).
        k_cache, v_cache, block_tables, scale, out, max_context_len, partition_size, k_scale,
            v_scale: as for :func:`sluiceway_kernels.paged_decode_attention` (a float8 cache divides the new
            key and value by their scales and rounds them as ``store_kvcache`` does).
        context_lens: (B,) tokens per sequence including the new one, whose position in the
            cache is ``context_lens - 1``; 0 for a padding row (zero output).
        slot_mapping: (B,) the new token's cache slot (block * block_size + offset); -1 stores
            nothing.
        positions: (B,) rotary positions; cos_sin_cache: (max_pos, R), R even and <= D, cos |
            sin, as for :func:`sluiceway_kernels.apply_rotary`; is_neox: its pairing of dims.

    Returns ``out`` (B, Hq, D). The new token is attended from registers, so no program reads
    the cache slot that another one writes.
    """
    out = _check_decode(q, k_cache, v_cache, block_tables, context_lens, out)
    batch, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, FLOAT_DTYPES)
        check_shape(name, t, (batch, num_kv_heads, head_dim))
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}; expected q's {q.dtype}")
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_shape("slot_mapping", slot_mapping, (batch,))
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_shape("positions", positions, (batch,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot == 0 or rot > head_dim:
        raise ValueError(f"cos_sin_cache width {rot} must be even, positive and <= head_dim {head_dim}")
    scales = dict(k_scale=k_scale, v_scale=v_scale) if check_kv_scales(k_scale, v_scale, k_cache.dtype) else {}
    check_same_device(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      context_lens=context_lens, slot_mapping=slot_mapping, positions=positions,
                      cos_sin_cache=cos_sin_cache, out=out, **scales)
    return launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len,
                         partition_size, fused=(k, v, positions, cos_sin_cache, slot_mapping, is_neox),
                         kv_scales=(k_scale, v_scale) if scales else None)


def rope_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    scale: float,
    is_neox: bool = True,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`rope_decode_attention`: the three unfused references in turn, on
    copies of q and k (same arguments; max_context_len and partition_size are unused)."""
    q, k = q.clone(), k.clone()
    apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox=is_neox)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                      k_scale=k_scale, v_scale=v_scale)
