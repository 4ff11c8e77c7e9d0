"""The new token of a fused decode step (``rope_decode_attention``): rotated, stored and
folded into the running softmax from registers, inside the decode kernel."""

from __future__ import annotations

from sluiceway_kernels._common import tl, triton
from sluiceway_kernels.store_kvcache import _round_to_e4m3 as round_to_e4m3


@triton.jit
def fold_new_token(
    q, m_i, l_i, acc, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, seq, kv_head,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    dims, dim_mask, partner, sign, cos, sin, scale_log2, k_scale, v_scale,
    split, used, context_len, BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr, KV_SCALED: tl.constexpr,
    SCALE_TILES: tl.constexpr,
):
    """Rotate the new key, round it and the new value to the cache's dtype (divided by their
    scales first), store both (the first split only) and fold them into the running softmax
    (the split that ends the context) as the cached tokens are."""
    k_row = k_new_ptr + seq.to(tl.int64) * stride_kt + kv_head * stride_kh
    k = tl.load(k_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    k_pair = tl.load(k_row + partner, mask=dim_mask, other=0.0).to(tl.float32)
    k = (k * cos + sign * k_pair * sin).to(k_new_ptr.dtype.element_ty).to(tl.float32)
    v = tl.load(v_new_ptr + seq.to(tl.int64) * stride_vt + kv_head * stride_vh + dims,
                mask=dim_mask, other=0.0).to(tl.float32)
    if SATURATE > 0:  # a float8 cache
        if KV_SCALED:
            k = tl.math.div_rn(k, k_scale)
            v = tl.math.div_rn(v, v_scale)
        k = round_to_e4m3(k, SATURATE)
        v = round_to_e4m3(v, SATURATE)
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + dims
    # NOTE: the scalar conditions are widened to blocks first: the interpreter turns a bool
    # block & a bool scalar into integers, which it refuses as a mask.
    zero = tl.zeros_like(dims)
    write = dim_mask & (slot + zero >= 0) & (split + zero == 0)
    tl.store(k_cache_ptr + dst, k, mask=write)
    tl.store(v_cache_ptr + dst, v, mask=write)

    if SCALE_TILES:  # read back as a cache tile is
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    k = k.to(q.dtype).to(tl.float32)
    s = tl.sum(q.to(tl.float32) * k[None, :], 1) * scale_log2  # (BLOCK_G,)
    s = tl.where((split == used - 1) & (context_len > 0), s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v.to(q.dtype).to(tl.float32)[None, :]
    return m_new, l_i, acc
