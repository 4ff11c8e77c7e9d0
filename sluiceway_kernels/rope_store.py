"""Rotary embedding and the KV-cache store of a step's new tokens, in one launch.

A prompt-carrying step rotates q and k, then scatters k and v into the paged cache: two
launches a layer, each paying the host's launch cost on the eager path that bounds a
prefill's latency. This kernel does both per token: q is rotated in place, the rotated key
and the value go to the token's cache slot.
"""

from __future__ import annotations

import torch

from sluiceway_kernels._common import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    INDEX_DTYPES,
    KV_DTYPES,
    check_kv_scales,
    check_same_device,
    check_shape,
    check_tensor,
    next_pow2,
    tl,
    triton,
)
from sluiceway_kernels.rotary import _rotate_heads, apply_rotary_ref
from sluiceway_kernels.store_kvcache import _round_to_e4m3, store_kvcache_ref


@triton.jit
def _rotated(x_ptr, offsets, partner, mask, cos, sin, sign, rotating):
    """The heads at ``offsets`` rotated (fp32, then rounded to x's dtype, as ``apply_rotary``
    stores them): ``x * cos + sign * x[partner] * sin`` on the rotary dims, ``x`` past them.
    Read-only: the result goes elsewhere (a thread's partner element may sit in another thread)."""
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    other = tl.load(x_ptr + partner, mask=mask & rotating, other=0.0).to(tl.float32)
    # NOTE: the first of a pair is x1*cos - x2*sin, the second x2*cos + x1*sin, as the same
    # explicit fmas as apply_rotary's (the compiler's own contraction differed between the two)
    first = tl.fma(xf, cos, -(other * sin))
    second = tl.fma(xf, cos, other * sin)
    return tl.where(rotating, tl.where(sign < 0, first, second), xf).to(x.dtype)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_ptr", "k_scale_ptr", "v_scale_ptr"])
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_cos,
    block_size, num_q_heads, num_kv_heads, head_dim, half,
    IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr, SATURATE: tl.constexpr, KV_SCALED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    rotating = dims < 2 * half
    if IS_NEOX:  # dim i pairs with i + half
        pair = tl.where(dims < half, dims, dims - half)
        partner = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1, 1)
    else:  # dim 2i pairs with 2i + 1
        pair = dims // 2
        partner = dims ^ 1
        sign = tl.where(dims % 2 == 0, -1, 1)
    pair = tl.where(rotating, pair, 0)
    partner = tl.where(rotating, partner, dims)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + pair, mask=rotating, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos + half + pair, mask=rotating, other=0.0).to(tl.float32)[None, :]
    rot = rotating[None, :]
    sgn = sign[None, :]

    # NOTE: q is rotated in place as apply_rotary does it, each thread loading and storing both
    # elements of its pairs: in place, a thread must not overwrite what another still reads
    pairs = tl.arange(0, BLOCK_HALF)
    cos_half = tl.load(cos_sin_ptr + pos * stride_cos + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    sin_half = tl.load(cos_sin_ptr + pos * stride_cos + half + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos_half[None, :], sin_half[None, :], half,
                  IS_NEOX, BLOCK_HQ, BLOCK_HALF)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding token stores nothing
        heads = tl.arange(0, BLOCK_HK)[:, None]
        mask = (heads < num_kv_heads) & (dims[None, :] < head_dim)
        k = _rotated(k_ptr + token * stride_kt + heads * stride_kh, dims[None, :], partner[None, :], mask,
                     cos, sin, sgn, rot)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims[None, :], mask=mask)
        if SATURATE > 0:  # a float8 cache: as store_kvcache rounds it
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if KV_SCALED:
                k = tl.math.div_rn(k, tl.load(k_scale_ptr))
                v = tl.math.div_rn(v, tl.load(v_scale_ptr))
            k = _round_to_e4m3(k, SATURATE)
            v = _round_to_e4m3(v, SATURATE)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims[None, :]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``apply_rotary(q, k, ...)`` then ``store_kvcache(k, v, ...)``, in one launch.

    Args:
        q: (T, Hq, D); k, v: (T, Hkv, D), q's dtype; token and head dims may be strided (views
            of a fused qkv output), D contiguous.
        k_cache, v_cache, slot_mapping, k_scale, v_scale: as for
            :func:`sluiceway_kernels.store_kvcache` (slot -1 stores nothing).
        positions, cos_sin_cache, is_neox: as for :func:`sluiceway_kernels.apply_rotary`.

    q is rotated in place; k is left as it came (its rotated copy is in the cache). The cache
    holds what the two kernels would have written, bit for bit. No host synchronisation.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    check_tensor("v_cache", v_cache, 4, KV_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    check_shape("v", v, k.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_shape("positions", positions, (num_tokens,))
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} does not match q's {head_dim}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"k_cache and v_cache must both have q's dtype or both be {FP8_KV_DTYPE}: "
                         f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot == 0 or rot > head_dim:
        raise ValueError(f"cos_sin_cache width {rot} must be even, positive and <= head_dim {head_dim}")
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    scales = dict(k_scale=k_scale, v_scale=v_scale) if scaled else {}
    check_same_device(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                      positions=positions, cos_sin_cache=cos_sin_cache, **scales)
    if num_tokens == 0:
        return
    block_hq, block_d = next_pow2(num_q_heads), next_pow2(head_dim)
    _rope_store_kernel[(num_tokens,)](
        q, k, v, k_cache, v_cache, positions, cos_sin_cache, slot_mapping,
        k_scale if scaled else slot_mapping, v_scale if scaled else slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0),
        block_size, num_q_heads, num_kv_heads, head_dim, rot // 2,
        IS_NEOX=bool(is_neox), BLOCK_HQ=block_hq, BLOCK_HK=next_pow2(num_kv_heads), BLOCK_D=block_d,
        BLOCK_HALF=next_pow2(rot // 2), SATURATE=FP8_KV_MAX if k_cache.dtype == FP8_KV_DTYPE else 0.0, KV_SCALED=scaled,
        num_warps=4 if block_hq * block_d >= 2048 else 1,
    )


def rope_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain-torch :func:`rope_store`: the two references one after the other (k untouched)."""
    k = k.clone()
    apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
