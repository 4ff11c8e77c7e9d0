"""Write the new tokens' keys and values into the paged KV cache."""

from __future__ import annotations

import torch

from sluiceway_kernels._common import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    KV_DTYPES,
    check_kv_scales,
    check_same_device,
    check_shape,
    check_tensor,
    next_pow2,
    tl,
    triton,
)


@triton.jit
def _round_to_e4m3(x, SATURATE: tl.constexpr):
    """fp32 ``x`` clamped to +-SATURATE and rounded to the nearest float8 e4m3 value (ties to
    even), still in fp32, so the conversion that follows is exact. NaN stays NaN, and a zero
    keeps its sign.

    NOTE: rounded here rather than by the conversion: Triton's interpreter truncates in its
    fp32 -> float8 conversion, and one code path serves it and the GPU alike.
    """
    mag = tl.minimum(tl.abs(x), SATURATE, propagate_nan=tl.PropagateNan.ALL)
    exponent = tl.maximum(((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-6's
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = quantum * 12582912.0  # 1.5 * 2^23 quanta: adding it rounds to a whole quantum
    rounded = (mag + magic) - magic
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit, -0 and -NaN too


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "k_scale_ptr", "v_scale_ptr"])
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr, KV_SCALED: tl.constexpr,
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
    if SATURATE > 0:  # a float8 cache: divide by the scale, clamp to the largest finite value, round
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if KV_SCALED:
            k = tl.math.div_rn(k, tl.load(k_scale_ptr))  # rounded as torch divides
            v = tl.math.div_rn(v, tl.load(v_scale_ptr))
        k = _round_to_e4m3(k, SATURATE)
        v = _round_to_e4m3(v, SATURATE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter this step's keys and values into their cache slots, in place.

    Args:
        key, value: (T, Hkv, D), the cache's dtype; the token and head dims may be strided
            (e.g. views into a fused qkv output), the last dim must be contiguous.
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), same shape, contiguous in D; key's
            dtype, or float8 e4m3 for any key dtype (values are divided by their scale,
            clamped to +-448, then rounded to nearest).
        slot_mapping: (T,) int32/int64; slot = block_id * block_size + offset; a negative
            slot (-1) skips that token.
        k_scale, v_scale: a float8 cache's per-layer scales, one float32 value each on the
            cache's device (see ``sluiceway_kernels._common.check_kv_scales``); None is a scale of 1.

    No host synchronisation: safe inside CUDA-graph capture.
    """
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    check_tensor("v_cache", v_cache, 4, KV_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, key.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"k_cache heads/dim {tuple(k_cache.shape[2:])} do not match key's {tuple(key.shape[1:])}"
        )
    if key.dtype != value.dtype or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (key.dtype, FP8_KV_DTYPE):
        raise ValueError(
            f"key/value/cache dtypes must match (or the caches be {FP8_KV_DTYPE}): key {key.dtype}, "
            f"value {value.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    scales = dict(k_scale=k_scale, v_scale=v_scale) if scaled else {}
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, **scales)
    if num_tokens == 0:
        return

    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    num_warps = 4 if block_h * block_d >= 2048 else 1
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale if scaled else slot_mapping,
        v_scale if scaled else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
        SATURATE=FP8_KV_MAX if k_cache.dtype == FP8_KV_DTYPE else 0.0, KV_SCALED=scaled,
    )


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain-torch :func:`store_kvcache`: same arguments, same in-place effect."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0  # (T,)
    slots = slot_mapping[keep].long()  # (T',)
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = src[keep]
        flat = cache.view(num_blocks * block_size, *cache.shape[2:])  # (slots, Hkv, D)
        if cache.dtype == FP8_KV_DTYPE:
            rows = rows.float() / scale.reshape(()) if scaled else rows.float()
            # NOTE: index_copy_ has no float8 kernel on CPU; the bytes are copied as uint8
            rows = rows.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE).view(torch.uint8)
            flat = flat.view(torch.uint8)
        flat.index_copy_(0, slots, rows.to(flat.dtype))
