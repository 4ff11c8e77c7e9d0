"""Test inputs for the paged kernels, and a naive dense attention to check references against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (atol, rtol) for a kernel against the fp32 reference, by dtype
TOLERANCE = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (3e-3, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}
HALF_DTYPES = [torch.float16, torch.bfloat16]
ALL_DTYPES = [torch.float32, *HALF_DTYPES]


def gpu_test(fn):
    """Mark a test as needing a CUDA GPU (``-m gpu`` selects these; skipped without CUDA)."""
    return pytest.mark.gpu(requires_gpu(fn))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    atol, rtol = TOLERANCE[dtype or actual.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    """A tensor of NaNs, so any element a kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class PagedBatch:
    q: torch.Tensor  # (T, Hq, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32
    context_lens: torch.Tensor  # (B,) int32
    query_start_loc: torch.Tensor  # (B+1,) int32
    dense_k: list[torch.Tensor]  # per sequence (context_len, Hkv, D), the un-paged keys
    dense_v: list[torch.Tensor]
    context: list[int]
    query: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query, default=0)


def make_paged_batch(
    context: list[int],
    query: list[int] | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    spare_columns: int = 1,
) -> PagedBatch:
    """Sequences with the given context lengths, paged into shuffled blocks of a NaN cache.

    query[b] new tokens (default 1) sit at the end of each context. Blocks no sequence owns
    and the tail of each last block stay NaN, so reading past a context poisons the output.
    Block-table padding is 0, as the engine writes it.
    """
    query = [1] * len(context) if query is None else query
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(c / block_size) for c in context]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(context), max(pages, default=0) + spare_columns, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, ctx in enumerate(context):
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        owned = [order.pop() for _ in range(pages[b])]
        for page, block in enumerate(owned):
            chunk = slice(page * block_size, min(ctx, (page + 1) * block_size))
            k_cache[block, : chunk.stop - chunk.start] = k[chunk]
            v_cache[block, : chunk.stop - chunk.start] = v[chunk]
            block_tables[b, page] = block
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(query), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + query, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PagedBatch(
        q=q.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor(context, dtype=torch.int32, device=DEVICE),
        query_start_loc=starts.to(DEVICE),
        dense_k=dense_k,
        dense_v=dense_v,
        context=list(context),
        query=list(query),
    )


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Causal attention from the un-paged K/V in float64 with an explicit softmax: (T, Hq, D)."""
    q = batch.q.double().cpu()
    num_heads = q.shape[1]
    out = torch.zeros_like(q)
    t = 0
    for b, (ctx, q_len) in enumerate(zip(batch.context, batch.query, strict=False)):
        group = num_heads // batch.dense_k[b].shape[1]
        k = batch.dense_k[b].double().repeat_interleave(group, dim=1)  # (ctx, Hq, D)
        v = batch.dense_v[b].double().repeat_interleave(group, dim=1)
        for i in range(q_len):
            visible = ctx - q_len + i + 1
            scores = (k[:visible] * q[t]).sum(-1) * scale  # (visible, Hq)
            weights = torch.exp(scores - scores.max(0).values)
            weights = weights / weights.sum(0)
            out[t] = (weights[:, :, None] * v[:visible]).sum(0)
            t += 1
    return out
