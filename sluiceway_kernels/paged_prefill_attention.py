"""Causal attention for a varlen batch of new tokens, all K/V read from the paged cache.

One motion covers prefill, chunked prefill, prefix-cache hits and decode: the q_len new
tokens of a sequence are the last q_len of its context_len tokens, and query token i sits
at position context_len - q_len + i and sees positions up to its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sluiceway_kernels._attention_tiles import kv_tile_offsets, online_softmax_step, scale_tiles, to_dot_dtype
from sluiceway_kernels._common import (
    INDEX_DTYPES,
    check_paged_attention,
    check_kv_scales,
    check_same_device,
    check_shape,
    check_tensor,
    dot_options,
    next_pow2,
    tl,
    triton,
)

LOG2E = 1.4426950408889634


@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "context_lens_ptr", "block_tables_ptr",
                                    "k_scale_ptr", "v_scale_ptr"],
)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, context_lens_ptr, block_tables_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    head_dim,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_SCALED: tl.constexpr, SCALE_TILES: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_HALF: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Query tiles are numbered so that sequence b owns tiles [first(b), first(b+1)) with
    # first(b) = query_start_loc[b] // TILE_Q + b: enough for ceil(q_len / TILE_Q) tiles, and
    # the grid needs only T // TILE_Q + B programs. Find b by binary search.
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // TILE_Q + mid <= tile_id:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    first_token = (tile_id - (q_start // TILE_Q + seq)) * TILE_Q  # within the sequence's query
    if first_token >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    cached = context_len - q_len  # tokens before the query

    # Row r of the tile is query token first_token + r // GROUP, head kv_head * GROUP + r % GROUP:
    # the heads sharing a kv head share every K/V tile.
    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP  # (BLOCK_M,)
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TILE_Q * GROUP) & (token < q_len)
    q_pos = cached + token  # absolute position of each row's token
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_offsets = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_offsets[:, None] + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q = to_dot_dtype(q, DOT_UPCAST, DOT_HALF)
    k_scale = 1.0
    v_scale = 1.0
    if KV_SCALED:  # the cache holds K / k_scale and V / v_scale (see scale_tiles)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if not SCALE_TILES:
            scale_log2 = scale_log2 * k_scale

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    tile = tl.arange(0, BLOCK_N)
    last_token = tl.minimum(first_token + TILE_Q, q_len) - 1
    kv_end = cached + last_token + 1  # the tile's last row sees up to here
    # Tiles wholly at or before the tile's first position need no causal mask.
    unmasked_end = ((cached + first_token + 1) // BLOCK_N) * BLOCK_N
    for kv_start in range(0, unmasked_end, BLOCK_N):
        pos = kv_start + tile
        valid = pos < kv_end
        offsets = kv_tile_offsets(block_table, pos, valid, kv_head * stride_ch, stride_cb, stride_cs, BLOCK_SIZE)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(
            q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, k_scale, v_scale, DOT_PRECISION, SCALE_TILES
        )
    for kv_start in range(unmasked_end, kv_end, BLOCK_N):
        pos = kv_start + tile
        valid = pos < kv_end
        offsets = kv_tile_offsets(block_table, pos, valid, kv_head * stride_ch, stride_cb, stride_cs, BLOCK_SIZE)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = online_softmax_step(
            q, k, v, visible, m_i, l_i, acc, scale_log2, k_scale, v_scale, DOT_PRECISION, SCALE_TILES
        )

    if KV_SCALED:
        if not SCALE_TILES:  # folded: V's scale on the output
            acc = acc * v_scale
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + out_offsets[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def prefill_config(group: int, head_dim: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N kv positions, num_warps, num_stages); rows = tokens x group heads."""
    block_d = next_pow2(head_dim)
    block_m = 128 if block_d <= 128 else 64
    # NOTE: short queries (decode-heavy batches) get short tiles: rows past q_len are waste.
    block_m = max(min(block_m, next_pow2(max_query_len * group)), 16, next_pow2(group))
    block_n = 64 if block_d <= 128 else 32
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    return block_m, block_n, num_warps, 2


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Args:
        q: (T, Hq, D), the new tokens of all B sequences back to back; token and head dims
            may be strided, D contiguous.
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), q's dtype or float8 e4m3, already
            holding the new tokens' K/V. Hq must be a multiple of Hkv. block_size: a power of two up to 256.
        query_start_loc: (B+1,) int32/int64 cumulative query lengths, starting at 0. Rows of q
            past query_start_loc[-1] (padding) are allowed; their output rows are not written.
        context_lens: (B,) int32/int64, tokens per sequence including the new ones.
        block_tables: (B, max_blocks) int32/int64, contiguous rows.
        scale: softmax scale, usually D ** -0.5.
        max_query_len: host-side bound on the query lengths; sizes the tiles only (any
            value >= the true maximum is correct).
        out: optional (T, Hq, D) output of q's dtype, D contiguous.
        k_scale, v_scale: a float8 cache's per-layer scales (one float32 value each, on the
            device; the cache holds K / k_scale and V / v_scale); None is a scale of 1.

    Returns: ``out``, (T, Hq, D). fp32 accumulation; no host synchronisation.
    """
    check_paged_attention(q, k_cache, v_cache)
    check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must hold B+1 entries")
    check_shape("context_lens", context_lens, (num_seqs,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, 3, (q.dtype,))
        check_shape("out", out, q.shape)
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc,
        context_lens=context_lens, block_tables=block_tables, out=out,
        **(dict(k_scale=k_scale, v_scale=v_scale) if scaled else {}),
    )
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = prefill_config(group, head_dim, max(1, max_query_len))
    tile_q = block_m // group  # query tokens per tile
    grid = (num_tokens // tile_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, query_start_loc, context_lens, block_tables, out,
        k_scale if scaled else out, v_scale if scaled else out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        GROUP=group, TILE_Q=tile_q, BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, KV_SCALED=scaled, SCALE_TILES=scale_tiles(scaled, q.dtype),
        **dot_options(q.dtype, k_cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`paged_prefill_attention`, one sequence at a time, in fp32 (the cache
    widened and multiplied by its scales).

    Gathers each sequence's pages and runs ``scaled_dot_product_attention`` with a
    bottom-right causal mask (query i of q_len sees keys up to context_len - q_len + i).
    Reads query_start_loc and context_lens on the host.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    result = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    scaled = check_kv_scales(k_scale, v_scale, k_cache.dtype)
    starts = query_start_loc.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0 or context_len == 0:
            continue
        pages = block_tables[b, : math.ceil(context_len / block_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:context_len]  # (S, Hkv, D)
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:context_len]
        if scaled:
            k, v = k.float() * k_scale.reshape(()), v.float() * v_scale.reshape(())
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)  # (L,)
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # (L, S)
        o = F.scaled_dot_product_attention(
            q[starts[b] : starts[b + 1]].float().transpose(0, 1)[None],  # (1, Hq, L, D)
            k.float().transpose(0, 1)[None],  # (1, Hkv, S, D)
            v.float().transpose(0, 1)[None],
            attn_mask=visible,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # (1, Hq, L, D)
        result[starts[b] : starts[b + 1]] = o[0].transpose(0, 1)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
