"""A mixed step's leading decodes through the decode kernel and the rest through the prefill
kernel give what the torch backend gives for the whole batch (compiled on a GPU, else
through the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine.runner.attention.metadata import AttentionMetadata
from engine.runner.attention.torch_backend import TorchAttentionBackend
from sluiceway_kernels._common import interpreting

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                       reason="runs the Triton kernels on a GPU or through the CPU interpreter"),
]


def mixed_step(contexts: list[int], queries: list[int], dtype: torch.dtype, block_size: int = 16,
               heads: int = 8, kv_heads: int = 2, head_dim: int = 64):
    gen = torch.Generator().manual_seed(len(contexts))
    pages = [-(-c // block_size) for c in contexts]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(p)] for p in pages]
    width = max(pages)
    slots = []
    for table, c, q in zip(tables, contexts, queries):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - q, c)]
    starts = torch.tensor([0] + queries).cumsum(0).to(torch.int32)
    num_decodes = next((i for i, q in enumerate(queries) if q != 1), len(queries))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        query_start_loc=starts.to(DEVICE), max_query_len=max(queries), max_context_len=max(contexts),
        decode_only=False, num_decodes=num_decodes,
    )
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    t = sum(queries)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_split_matches_torch_backend(dtype):
    from engine.runner.attention.triton_backend import TritonAttentionBackend

    contexts = [300, 1, 17, 64, 40, 33]  # three decodes, then a whole prompt, a chunk, a prefix hit
    queries = [1, 1, 1, 64, 24, 3]
    q, k, v, (k_cache, v_cache), meta = mixed_step(contexts, queries, dtype)
    assert meta.num_decodes == 3
    ref_cache = (k_cache.clone(), v_cache.clone())
    got = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, *ref_cache, meta, 0.125)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_the_split_is_sliced_once_a_step_with_the_prompts_queries_from_zero():
    contexts, queries = [300, 1, 17, 64, 40], [1, 1, 1, 64, 24]
    *_, meta = mixed_step(contexts, queries, torch.float32)
    decodes, rest = meta.split()
    assert meta.split()[0] is decodes and meta.split()[1] is rest  # every layer reuses them
    assert decodes.decode_only and decodes.max_query_len == 1 and decodes.num_decodes == 0
    assert decodes.context_lens.tolist() == [300, 1, 17] and decodes.block_tables.shape[0] == 3
    assert decodes.slot_mapping.tolist() == meta.slot_mapping[:3].tolist()
    assert rest.query_start_loc.tolist() == [0, 64, 88] and rest.context_lens.tolist() == [64, 40]
    assert torch.equal(rest.block_tables, meta.block_tables[3:]) and rest.slot_mapping.numel() == 88
    assert not rest.decode_only and rest.num_decodes == 0 and rest.max_query_len == 64
