"""Triton building blocks shared by the paged attention kernels.

Both kernels walk a sequence's context in tiles of BLOCK_N token positions. Each position
finds its page through the block table (one small gather per tile), so a tile may span
several cache blocks or lie inside one: any power-of-two block size works.
"""

from __future__ import annotations

import torch

from sluiceway_kernels._common import tl, triton


@triton.jit
def kv_tile_offsets(
    block_table_ptr,  # this sequence's row of the block table
    pos,  # (BLOCK_N,) absolute token positions
    valid,  # (BLOCK_N,) which positions exist
    head_offset,  # kv_head * stride of the head dim
    stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets of (position, kv head, dim 0) in a (blocks, block_size, Hkv, D) cache."""
    page = pos // BLOCK_SIZE
    physical = tl.load(block_table_ptr + page, mask=valid, other=0).to(tl.int64)
    return physical * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_offset


@triton.jit
def to_dot_dtype(q, DOT_UPCAST: tl.constexpr, DOT_HALF: tl.constexpr):
    """Queries in the dtype the tile dots run in (``sluiceway_kernels._common.dot_options``)."""
    if DOT_UPCAST:
        q = q.to(tl.float32)
    elif DOT_HALF:
        q = q.to(tl.float16)
    return q


@triton.jit
def online_softmax_step(
    q,  # (M, BLOCK_D) queries, already in the dot dtype
    k,  # (BLOCK_N, BLOCK_D), the cache's dtype
    v,  # (BLOCK_N, BLOCK_D)
    visible,  # (M, BLOCK_N) or (1, BLOCK_N): which scores count
    m_i, l_i, acc,  # running max (log2 units), running sum, unnormalised output
    scale_log2,
    k_scale, v_scale,  # a float8 cache's per-layer scales (fp32 scalars), used when SCALE_TILES
    DOT_PRECISION: tl.constexpr, SCALE_TILES: tl.constexpr,
):
    """Fold one KV tile into the running softmax state (flash-attention update, base 2)."""
    # a float8 cache tile, or any tile when the dot runs in fp32, widens to q's dtype first
    if SCALE_TILES:  # the cache holds K / k_scale and V / v_scale: multiply back as the tile widens
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (M, BLOCK_N)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (M,)
    # A row with nothing visible so far keeps m = -inf; shift by 0 there to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # (M,)
    p = tl.exp2(s - m_safe[:, None])  # (M, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def scale_tiles(kv_scaled: bool, q_dtype: torch.dtype) -> bool:
    """Whether a scaled float8 cache's tiles are multiplied by their scales element by element
    (fp32 queries) rather than k_scale folded into the softmax scale and v_scale into the output.

    NOTE: the same math either way. fp32 queries multiply each element, as the references do,
    so the CPU runs (the interpreter) match them bit for bit; half-precision queries fold: no
    per-element work, and multiplying each element of a float8 tile staged the loop through
    2.5x the shared memory (102,400 bytes for llama3-8b heads on sm_90, past the 99 KB an Ada
    block may have).
    """
    return kv_scaled and q_dtype == torch.float32


@triton.jit
def merge_partial_heads(
    part_acc_ptr, part_m_ptr, part_l_ptr,
    rows0,  # (MERGE_G,) index of (sequence, head, split 0) of each head
    head_mask,  # (MERGE_G,) heads that exist
    used, dims, dim_mask, head_dim,
    SPLIT_CHUNK: tl.constexpr,
):
    """The outputs of several heads, (MERGE_G, BLOCK_D), from the partial softmax states of their
    ``used`` context splits.

    The partials were written by other programs of the same launch, so they are read past
    the SM's L1 (``.cg``), which may hold lines of an earlier use of the buffers.

    NOTE: one program merges all the query heads of a kv head in one pass. Head by head, each
    merge's loads waited for the previous head's store (they may alias as far as the compiler
    knows): GROUP dependent round trips to memory at the tail of a split launch, 2.4% of a
    batch-1 step on an H100 (6.03 ms against 6.18).
    """
    splits0 = tl.arange(0, SPLIT_CHUNK)
    m_all = tl.full(rows0.shape, float("-inf"), tl.float32)
    l_all = tl.zeros(rows0.shape, tl.float32)
    acc = tl.zeros((rows0.shape[0], dims.shape[0]), tl.float32)
    for chunk in range(0, used, SPLIT_CHUNK):
        splits = chunk + splits0
        live = head_mask[:, None] & (splits < used)[None, :]  # (MERGE_G, SPLIT_CHUNK)
        rows = rows0[:, None] + splits[None, :]
        m_s = tl.load(part_m_ptr + rows, mask=live, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_l_ptr + rows, mask=live, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(
            part_acc_ptr + rows[:, :, None] * head_dim + dims[None, None, :],
            mask=live[:, :, None] & dim_mask[None, None, :], other=0.0, cache_modifier=".cg",
        )  # (MERGE_G, SPLIT_CHUNK, BLOCK_D)
        m_new = tl.maximum(m_all, tl.max(m_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_all - m_safe)
        w = tl.exp2(m_s - m_safe[:, None])  # (MERGE_G, SPLIT_CHUNK)
        l_all = l_all * alpha + tl.sum(w * l_s, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * acc_s, 1)
        m_all = m_new
    return acc / tl.where(l_all > 0, l_all, 1.0)[:, None]


@triton.jit
def rope_factors(cos_sin_row_ptr, dims, half, IS_NEOX: tl.constexpr):
    """(partner, sign, cos, sin) per head dim, so that a rotated row is
    ``x * cos + sign * x[partner] * sin``; dims past the rotary width keep x (cos 1, sin 0).

    ``cos_sin_row_ptr``: this position's row of the (max_pos, 2 * half) table, cos | sin.
    """
    rotated = dims < 2 * half
    if IS_NEOX:  # dim i pairs with i + half
        first = dims < half
        partner = tl.where(first, dims + half, dims - half)
        freq = tl.where(first, dims, dims - half)
        sign = tl.where(first, -1.0, 1.0)
    else:  # dim 2i pairs with 2i + 1
        partner = dims ^ 1
        freq = dims // 2
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    partner = tl.where(rotated, partner, dims)
    cos = tl.load(cos_sin_row_ptr + freq, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_row_ptr + half + freq, mask=rotated, other=0.0).to(tl.float32)
    return partner, sign, cos, sin
