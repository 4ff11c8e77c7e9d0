"""Decode attention over the paged KV cache: one query token per sequence, split-K."""

from __future__ import annotations

import math

import torch

from kernels._attention_tiles import kv_tile_offsets, online_softmax_step, to_dot_dtype
from kernels._common import (
    INDEX_DTYPES,
    check_paged_attention,
    check_same_device,
    check_shape,
    check_tensor,
    dot_options,
    next_pow2,
    num_sms,
    tl,
    triton,
)

LOG2E = 1.4426950408889634
MIN_PARTITION = 256  # tokens: below this a split costs more than it saves
SPLIT_CHUNK = 16  # splits folded per step of the reduction


@triton.jit(
    do_not_specialize=["stride_bt", "partition_size", "num_splits"],
    do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"],
)
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    head_dim, partition_size, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WRITE_FINAL: tl.constexpr,
    DOT_UPCAST: tl.constexpr, DOT_HALF: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * partition_size
    if not WRITE_FINAL:
        if start >= context_len:
            return  # the reduction reads only the splits this sequence uses
    # The last split runs to the end, so a context longer than the host bound stays exact.
    end = tl.where(split == num_splits - 1, context_len, tl.minimum(start + partition_size, context_len))

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g  # (BLOCK_G,) query heads sharing this kv head
    dims = tl.arange(0, BLOCK_D)
    head_mask = g < GROUP
    dim_mask = dims < head_dim
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :], other=0.0,
    )  # (BLOCK_G, BLOCK_D)
    q = to_dot_dtype(q, DOT_UPCAST, DOT_HALF)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    tile = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tile  # (BLOCK_N,)
        valid = pos < end
        offsets = kv_tile_offsets(block_table, pos, valid, kv_head * stride_ch, stride_cb, stride_cs, BLOCK_SIZE)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(
            q, k, v, valid[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION
        )

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if WRITE_FINAL:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split  # (BLOCK_G,)
        tl.store(part_m_ptr + row, m_i, mask=head_mask)
        tl.store(part_l_ptr + row, l_i, mask=head_mask)
        tl.store(part_acc_ptr + row[:, None] * head_dim + dims[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["partition_size", "num_splits"],
            do_not_specialize_on_alignment=["context_lens_ptr"])
def _decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, context_lens_ptr, out_ptr,
    stride_ob, stride_oh,
    head_dim, partition_size, num_splits,
    BLOCK_D: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    used = tl.minimum(tl.cdiv(context_len, partition_size), num_splits)
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim

    m_all = float("-inf")
    l_all = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for chunk in range(0, used, SPLIT_CHUNK):
        splits = chunk + tl.arange(0, SPLIT_CHUNK)
        live = splits < used
        m_s = tl.load(part_m_ptr + row0 + splits, mask=live, other=float("-inf"))
        l_s = tl.load(part_l_ptr + row0 + splits, mask=live, other=0.0)
        acc_s = tl.load(
            part_acc_ptr + (row0 + splits)[:, None] * head_dim + dims[None, :],
            mask=live[:, None] & dim_mask[None, :], other=0.0,
        )  # (SPLIT_CHUNK, BLOCK_D)
        m_new = tl.maximum(m_all, tl.max(m_s, 0))  # every used split saw a token: finite
        alpha = tl.exp2(m_all - m_new)
        w = tl.exp2(m_s - m_new)  # (SPLIT_CHUNK,)
        l_all = l_all * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * acc_s, 0)
        m_all = m_new

    out = acc / tl.where(l_all > 0, l_all, 1.0)
    dst = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def decode_config(head_dim: int, group: int, kv_itemsize: int = 2, q_itemsize: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N kv positions per tile, num_warps, num_stages) for the partition kernel.

    NOTE: over a float8 cache, half-precision queries take tiles twice as long, so each
    moves the bytes of a bf16 tile. On an H200 (llama3-8b heads, docs/BENCHMARKS.md) that
    matched bf16's time from 1 to 256 sequences, where 64-row float8 tiles took up to 1.4x
    as long at 32-64 sequences; at 512 sequences it is 9% slower than bf16. fp32 queries
    keep 64 rows: their widened 128-row tiles would need more shared memory than Ada has.
    """
    block_n = 64 if head_dim <= 128 else 32
    return (block_n * 2 if kv_itemsize == 1 and q_itemsize == 2 else block_n), 4, 2


def choose_partition(
    batch: int, num_kv_heads: int, max_context_len: int, block_n: int, num_sms: int
) -> tuple[int, int]:
    """(num_splits, partition_size) for a batch, from host-side sizes only.

    NOTE: split only as far as it takes to give every SM about two programs, and never into
    partitions shorter than MIN_PARTITION tokens; big batches run one partition per sequence.
    """
    max_context_len = max(1, max_context_len)
    want = math.ceil(2 * num_sms / max(1, batch * num_kv_heads))
    num_splits = max(1, min(want, math.ceil(max_context_len / MIN_PARTITION)))
    partition = math.ceil(math.ceil(max_context_len / num_splits) / block_n) * block_n
    return math.ceil(max_context_len / partition), partition


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
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole paged context.

    Args:
        q: (B, Hq, D); token and head dims may be strided, D contiguous.
        k_cache, v_cache: (num_blocks, block_size, Hkv, D), q's dtype; Hq must be a multiple
            of Hkv (MHA, GQA, MQA). block_size: a power of two up to 256.
        block_tables: (B, max_blocks) int32/int64, contiguous rows.
        context_lens: (B,) int32/int64, tokens per sequence including the new one, which is
            already in the cache. A sequence of length 0 gets a zero output.
        scale: softmax scale, usually D ** -0.5.
        out: optional (B, Hq, D) output of q's dtype, D contiguous.
        max_context_len: host-side upper bound on context_lens, used only to choose the number
            of context splits. Defaults to ``max_blocks * block_size``, which needs no sync.
            For CUDA graphs pass a bound that is fixed for the graph (e.g. max_model_len):
            every split count and buffer size then depends on host integers only.
        partition_size: tokens per split; overrides the automatic choice (tests use small ones).

    Returns: ``out``, (B, Hq, D). Accumulates in fp32. Long contexts with few sequences are
    split into partitions whose partial softmax states a second kernel merges.
    """
    check_paged_attention(q, k_cache, v_cache)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for a batch of {batch}")
    check_shape("context_lens", context_lens, (batch,))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, 3, (q.dtype,))
        check_shape("out", out, q.shape)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        context_lens=context_lens, out=out,
    )
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
        num_splits, partition_size = choose_partition(
            batch, num_kv_heads, max_context_len, block_n, num_sms(q.device)
        )

    common = dict(
        GROUP=group, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        **dot_options(q.dtype, k_cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    strides = (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
    )
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:
        _decode_partition_kernel[grid](
            q, k_cache, v_cache, block_tables, context_lens, out, out, out, out,
            scale * LOG2E, *strides, head_dim, partition_size, 1,
            WRITE_FINAL=True, **common,
        )
        return out

    part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_partition_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l,
        scale * LOG2E, *strides, head_dim, partition_size, num_splits,
        WRITE_FINAL=False, **common,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_acc, part_m, part_l, context_lens, out,
        out.stride(0), out.stride(1), head_dim, partition_size, num_splits,
        BLOCK_D=block_d, SPLIT_CHUNK=SPLIT_CHUNK, num_warps=4,
    )
    return out


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
) -> torch.Tensor:
    """Plain-torch :func:`paged_decode_attention` (same arguments; the last two are unused).

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

    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)  # (B, Hkv, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # (B, Hkv, G, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty contexts give zeros
    result = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(batch, num_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
