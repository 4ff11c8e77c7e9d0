"""Write the new tokens' keys and values into the paged KV cache."""

from __future__ import annotations

import torch

from kernels._common import (
    FLOAT_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    next_pow2,
    tl,
    triton,
)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    src_k = key_ptr + token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into their cache slots, in place.

    Args:
        key, value: (T, Hkv, D), the cache's dtype; the token and head dims may be strided
            (e.g. views into a fused qkv output), the last dim must be contiguous.
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), same shape, contiguous in D.
        slot_mapping: (T,) int32/int64; slot = block_id * block_size + offset; a negative
            slot (-1) skips that token.

    No host synchronisation: safe inside CUDA-graph capture.
    """
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, key.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"k_cache heads/dim {tuple(k_cache.shape[2:])} do not match key's {tuple(key.shape[1:])}"
        )
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"key/value/cache dtypes must match: key {key.dtype}, value {value.dtype}, "
            f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return

    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    num_warps = 4 if block_h * block_d >= 2048 else 1
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch :func:`store_kvcache`: same arguments, same in-place effect."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0  # (T,)
    slots = slot_mapping[keep].long()  # (T',)
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])  # (slots, Hkv, D)
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))
