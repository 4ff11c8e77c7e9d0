"""Decode attention over the paged KV cache: one query token per sequence, split-K in one launch."""

from __future__ import annotations

import math

import torch

from sluiceway_kernels._attention_tiles import (
    kv_tile_offsets,
    merge_partial_heads,
    online_softmax_step,
    rope_factors,
    scale_tiles,
    to_dot_dtype,
)
from sluiceway_kernels._decode_splits import MIN_PARTITION, SHORT_CONTEXT, choose_splits, decode_config
from sluiceway_kernels._common import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    INDEX_DTYPES,
    check_paged_attention,
    check_kv_scales,
    check_same_device,
    check_shape,
    check_tensor,
    dot_options,
    next_pow2,
    num_sms,
    pdl_options,
    split_counters,
    tl,
    triton,
    wait_for_previous,
)
from sluiceway_kernels._new_token import fold_new_token

LOG2E = 1.4426950408889634
# NOTE: each split reads its first tile of K/V before waiting for the kernel before it
# (programmatic dependent launch), so at batch 1 the reads overlap that kernel instead of
# following it: see the kernel's note on what may be read then. Built and off: not yet timed on
# a GPU (scripts/decode_split_sweep.py, scripts/gpu_small_batch_ab.sh stage early); the tests
# run both ways (tests/kernels/conftest.py: early_reads).
EARLY_READS = False
SPLIT_CHUNK = 16  # splits folded per step of the merge, at most


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, offsets, dims, mask):
    """A tile's K and V rows, (BLOCK_N, BLOCK_D) each, at ``offsets`` (``kv_tile_offsets``); 0 where masked."""
    rows = offsets[:, None] + dims[None, :]
    return (tl.load(k_cache_ptr + rows, mask=mask, other=0.0), tl.load(v_cache_ptr + rows, mask=mask, other=0.0))


@triton.jit(
    do_not_specialize=["stride_bt", "partition_size", "min_partition", "num_splits"],
    do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr", "positions_ptr", "slot_ptr",
                                    "k_scale_ptr", "v_scale_ptr"],
)
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, counter_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_rope,
    head_dim, rope_half, partition_size, min_partition, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, SHORT_CONTEXT: tl.constexpr,
    MERGE_G: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    FUSED: tl.constexpr, IS_NEOX: tl.constexpr, SATURATE: tl.constexpr, KV_SCALED: tl.constexpr,
    SCALE_TILES: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_HALF: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EARLY: tl.constexpr, PDL: tl.constexpr,
):
    if not EARLY:
        wait_for_previous(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # Tokens per split: fixed by the caller, or sized on the device from this sequence's
    # length, so a graph captured for a long bound still spreads a short context.
    if partition_size > 0:
        part = partition_size
    else:
        piece = tl.where(context_len <= SHORT_CONTEXT, BLOCK_N, min_partition)
        want = tl.minimum(tl.maximum(tl.cdiv(context_len, piece), 1), num_splits)
        part = tl.cdiv(tl.cdiv(tl.maximum(context_len, 1), want), BLOCK_N) * BLOCK_N
    used = tl.minimum(tl.maximum(tl.cdiv(context_len, part), 1), num_splits)
    start = split * part
    # The last split runs to the end, so a context longer than the host bound stays exact.
    end = tl.where(split == used - 1, context_len, tl.minimum(start + part, context_len))
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    tile = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    if EARLY:
        # NOTE: the split's first tile is read before the wait, while the kernel before this one
        # still runs: the lengths, the block table and every cached position but the new token's
        # were written before this step (the new token's K/V is stored by this kernel, or by the
        # store kernel just before it, and is read after the wait).
        pos0 = start + tile
        early = (pos0 < tl.minimum(end, context_len - 1)) & (tile * 0 + split < used)  # a block: see fold_new_token
        offsets0 = kv_tile_offsets(block_table, pos0, early, kv_head * stride_ch, stride_cb, stride_cs, BLOCK_SIZE)
        k0, v0 = _kv_tile(k_cache_ptr, v_cache_ptr, offsets0, dims, early[:, None] & dim_mask[None, :])
        wait_for_previous(PDL)
    if split >= used:
        return

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g  # (BLOCK_G,) query heads sharing this kv head
    head_mask = g < GROUP
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)  # (BLOCK_G, BLOCK_D)
    if FUSED:  # rotate the new query and key here; the new token's K/V never round-trip the cache
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        partner, sign, cos, sin = rope_factors(cos_sin_ptr + pos * stride_rope, dims, rope_half, IS_NEOX)
        q_pair = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_pair * sin[None, :]).to(q_ptr.dtype.element_ty)
        cached_end = tl.minimum(end, context_len - 1)  # the last position is the new token
    else:
        cached_end = end
    q = to_dot_dtype(q, DOT_UPCAST, DOT_HALF)
    k_scale = 1.0
    v_scale = 1.0
    if KV_SCALED:  # the cache holds K / k_scale and V / v_scale (see scale_tiles)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if not SCALE_TILES:
            scale_log2 = scale_log2 * k_scale

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    first = start
    if EARLY:
        if not FUSED:  # the new token's row, stored by the kernel before: read now, past the wait
            new_row = (pos0 == context_len - 1) & (pos0 < cached_end)
            offsets_new = kv_tile_offsets(block_table, pos0, new_row, kv_head * stride_ch, stride_cb, stride_cs,
                                          BLOCK_SIZE)
            new_mask = new_row[:, None] & dim_mask[None, :]
            k_new, v_new = _kv_tile(k_cache_ptr, v_cache_ptr, offsets_new, dims, new_mask)
            k0, v0 = tl.where(new_mask, k_new, k0), tl.where(new_mask, v_new, v0)
        m_i, l_i, acc = online_softmax_step(
            q, k0, v0, (pos0 < cached_end)[None, :], m_i, l_i, acc, scale_log2, k_scale, v_scale, DOT_PRECISION,
            SCALE_TILES
        )
        first = start + BLOCK_N
    for tile_start in range(first, cached_end, BLOCK_N):
        pos_n = tile_start + tile  # (BLOCK_N,)
        valid = pos_n < cached_end
        offsets = kv_tile_offsets(block_table, pos_n, valid, kv_head * stride_ch, stride_cb, stride_cs, BLOCK_SIZE)
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, offsets, dims, valid[:, None] & dim_mask[None, :])
        m_i, l_i, acc = online_softmax_step(
            q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, k_scale, v_scale, DOT_PRECISION, SCALE_TILES
        )

    if FUSED:
        m_i, l_i, acc = fold_new_token(
            q, m_i, l_i, acc, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, seq, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
            dims, dim_mask, partner, sign, cos, sin, scale_log2, k_scale, v_scale,
            split, used, context_len, BLOCK_SIZE, SATURATE, KV_SCALED, SCALE_TILES,
        )
    if KV_SCALED:
        if not SCALE_TILES:  # folded: V's scale on the output
            acc = acc * v_scale

    if SPLIT:
        if used > 1:
            row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # (BLOCK_G,)
            tl.store(part_m_ptr + row, m_i, mask=head_mask)
            tl.store(part_l_ptr + row, l_i, mask=head_mask)
            tl.store(part_acc_ptr + row[:, None] * head_dim + dims[None, :], acc, mask=q_mask)
            # NOTE: the last split to finish merges them all (no second launch): the barrier
            # orders every thread's partial stores before the counter's release.
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                mg = tl.arange(0, MERGE_G)
                m_heads = kv_head * GROUP + mg
                m_mask = mg < GROUP
                rows0 = (seq.to(tl.int64) * num_heads + m_heads) * num_splits
                merged = merge_partial_heads(part_acc_ptr, part_m_ptr, part_l_ptr, rows0, m_mask, used, dims,
                                             dim_mask, head_dim, MERGE_CHUNK)
                dst = out_ptr + seq.to(tl.int64) * stride_ob + m_heads[:, None] * stride_oh + dims[None, :]
                tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dim_mask[None, :])
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            return
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_decode(q, k_cache, v_cache, block_tables, context_lens, out):
    check_paged_attention(q, k_cache, v_cache)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES)
    batch = q.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for a batch of {batch}")
    check_shape("context_lens", context_lens, (batch,))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, 3, (q.dtype,))
        check_shape("out", out, q.shape)
    return out


def merge_options(group: int, block_d: int) -> dict:
    """How the last split merges: MERGE_G query heads at once, MERGE_CHUNK splits a step, so that
    a step's (heads, splits, head_dim) tile stays at 8,192 values."""
    merge_g = next_pow2(group)
    return {"MERGE_G": merge_g, "MERGE_CHUNK": max(1, min(SPLIT_CHUNK, 8192 // (merge_g * block_d)))}


def launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len,
                  partition_size, fused=None, kv_scales=None) -> torch.Tensor:
    """Launch the decode kernel on checked arguments; ``fused``: (k, v, positions, cos_sin_cache,
    slot_mapping, is_neox) for the rotary + store variant, or None; ``kv_scales``: checked
    (k_scale, v_scale) device tensors, or None for a scale of 1."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    block_g = max(16, next_pow2(group))
    block_n, num_warps, num_stages = decode_config(head_dim, group, k_cache.element_size(), q.element_size())
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if partition_size is not None:
        if partition_size < 1:
            raise ValueError(f"partition_size must be positive, got {partition_size}")
        num_splits = max(1, math.ceil(max_context_len / partition_size))
    else:
        num_splits = choose_splits(batch, num_kv_heads, max_context_len, num_sms(q.device), block_n)
        partition_size = 0
    if num_splits == 1:
        block_n, num_warps, num_stages = decode_config(head_dim, group, k_cache.element_size(), q.element_size(),
                                                       whole_contexts=True)
    # NOTE: the fused variant always takes the split path (which writes a single split's output
    # directly), so a model compiles one fused variant, at graph capture, whatever the bound.
    split = num_splits > 1 or fused is not None
    if split:
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        counters = split_counters(q.device, batch * num_kv_heads)
    else:
        part_acc = part_m = part_l = counters = out
    if fused is None:
        k = v = positions = cos_sin = slots = out
        rope_half, is_neox, kv_strides, rope_stride = 0, True, (0, 0, 0, 0), 0
    else:
        k, v, positions, cos_sin, slots, is_neox = fused
        rope_half, rope_stride = cos_sin.shape[1] // 2, cos_sin.stride(0)
        kv_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    k_scale, v_scale = kv_scales if kv_scales is not None else (out, out)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l, counters,
        k, v, positions, cos_sin, slots, k_scale, v_scale,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *kv_strides, rope_stride,
        head_dim, rope_half, partition_size, MIN_PARTITION, num_splits,
        GROUP=group, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        SPLIT=split, SHORT_CONTEXT=SHORT_CONTEXT, **merge_options(group, block_d), FUSED=fused is not None, IS_NEOX=bool(is_neox),
        SATURATE=FP8_KV_MAX if k_cache.dtype == FP8_KV_DTYPE else 0.0, KV_SCALED=kv_scales is not None, EARLY=EARLY_READS,
        SCALE_TILES=scale_tiles(kv_scales is not None, q.dtype),
        **dot_options(q.dtype, k_cache.dtype), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(q.device),
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole paged context, in one launch.

    Args:
        q: (B, Hq, D); token and head dims may be strided, D contiguous.
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), q's dtype or float8 e4m3; Hq must
            be a multiple of Hkv (MHA, GQA, MQA). block_size: a power of two up to 256.
        block_tables: (B, max_blocks) int32/int64, contiguous rows.
        context_lens: (B,) int32/int64, tokens per sequence including the new one, which is
            already in the cache. A sequence of length 0 gets a zero output.
        scale: softmax scale, usually D ** -0.5.
        out: optional (B, Hq, D) output of q's dtype, D contiguous.
        max_context_len: host-side upper bound on context_lens, used only to choose how many
            programs may split a context. Defaults to ``max_blocks * block_size``, which needs
            no sync. For CUDA graphs pass a bound that is fixed for the graph (e.g.
            max_model_len): the grid and buffer sizes then depend on host integers only.
        partition_size: tokens per split; overrides the automatic choice (tests use small ones).
        k_scale, v_scale: a float8 cache's per-layer scales (one float32 value each, on the
            device; the cache holds K / k_scale and V / v_scale); None is a scale of 1.

    Returns: ``out``, (B, Hq, D). Accumulates in fp32. A context split over several programs
    is merged by the last of them to finish (an arrival counter per sequence and kv head).
    """
    out = _check_decode(q, k_cache, v_cache, block_tables, context_lens, out)
    scales = dict(k_scale=k_scale, v_scale=v_scale) if check_kv_scales(k_scale, v_scale, k_cache.dtype) else {}
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      context_lens=context_lens, out=out, **scales)
    return launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len,
                         partition_size, kv_scales=(k_scale, v_scale) if scales else None)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`paged_decode_attention` (same arguments; max_context_len and
    partition_size are unused). The cache is widened to fp32 and multiplied by its scales.

    Gathers every sequence's K/V to the batch's longest context and masks the rest, all in
    fp32; one host sync reads the longest context.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    longest = int(context_lens.max()) if batch else 0
    num_pages = -(-longest // block_size)
    pages = block_tables[:, :num_pages].long()  # (B, P)
    k = k_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim)[:, :longest]  # (B, L, Hkv, D)
    v = v_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim)[:, :longest]
    valid = torch.arange(longest, device=q.device)[None, :] < context_lens[:, None]  # (B, L)
    # Zero the padding so stale (even NaN) cache contents cannot leak through 0 * NaN.
    k = k.float().masked_fill(~valid[:, :, None, None], 0.0)
    v = v.float().masked_fill(~valid[:, :, None, None], 0.0)
    if check_kv_scales(k_scale, v_scale, k_cache.dtype):
        k, v = k * k_scale.reshape(()), v * v_scale.reshape(())

    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)  # (B, Hkv, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # (B, Hkv, G, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty contexts give zeros
    result = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(batch, num_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
