"""Steps through ``forward_rotary``: the Triton backend (decodes: one fused launch for small
batches, rotary + store + attention for big ones; prompts: rotary and store in one launch,
then attention) gives what the torch backend gives, and leaves the same cache (compiled on a
GPU, else through the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine.runner.attention.metadata import AttentionMetadata
from engine.runner.attention.torch_backend import TorchAttentionBackend
from sluiceway_kernels import make_cos_sin_cache
from sluiceway_kernels._common import interpreting

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                       reason="runs the Triton kernels on a GPU or through the CPU interpreter"),
]


def decode_step(contexts: list[int], block_size: int = 16, heads: int = 4, kv_heads: int = 1, head_dim: int = 32):
    gen = torch.Generator().manual_seed(len(contexts))
    pages = [-(-c // block_size) for c in contexts]
    order = torch.randperm(sum(pages) + 1, generator=gen).tolist()
    tables = [[order.pop() for _ in range(p)] for p in pages]
    width = max(pages)
    slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size for t, c in zip(tables, contexts)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.arange(len(contexts) + 1, dtype=torch.int32, device=DEVICE),
        max_query_len=1, max_context_len=max(contexts), decode_only=True,
    )
    shape = (sum(pages) + 1, block_size, kv_heads, head_dim)
    cache = [torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2)]
    qkv = torch.randn(len(contexts), heads + 2 * kv_heads, head_dim, generator=gen).to(DEVICE)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    positions = torch.tensor([c - 1 for c in contexts], device=DEVICE)
    return q, k, v, cache, meta, positions, make_cos_sin_cache(max(contexts), head_dim, device=DEVICE)


@pytest.mark.parametrize("batch", [3, 40])  # fused, and past FUSED_DECODE_MAX_BATCH
def test_decode_step_matches_torch_backend(batch):
    from engine.runner.attention.triton_backend import FUSED_DECODE_MAX_BATCH, TritonAttentionBackend

    assert (batch <= FUSED_DECODE_MAX_BATCH) == (batch == 3)
    contexts = [1 + (37 * i) % 90 for i in range(batch)]
    q, k, v, (k_cache, v_cache), meta, positions, cos_sin = decode_step(contexts)
    ref_cache = (k_cache.clone(), v_cache.clone())
    ref = TorchAttentionBackend().forward_rotary(q.clone(), k.clone(), v, *ref_cache, meta, 0.2, positions, cos_sin)
    got = TritonAttentionBackend().forward_rotary(q, k, v, k_cache, v_cache, meta, 0.2, positions, cos_sin)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(k_cache, ref_cache[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v_cache, ref_cache[1], atol=0, rtol=0)


@pytest.mark.parametrize("contexts,queries", [
    ([300, 1, 17, 64, 40, 33], [1, 1, 1, 64, 24, 3]),  # three decodes (the fused kernel), then prefills
    ([64, 40, 33], [64, 24, 3]),  # prompts alone: rotated and stored in one launch
    ([5 + i for i in range(40)] + [70, 33], [1] * 40 + [50, 3]),  # more decodes than the fused kernel takes
])
def test_prompt_carrying_steps_match_torch_backend(contexts, queries):
    from test_attention_split import mixed_step

    from engine.runner.attention.triton_backend import TritonAttentionBackend

    q, k, v, (k_cache, v_cache), meta = mixed_step(contexts, queries, torch.float32)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(contexts, queries)]).to(DEVICE)
    cos_sin = make_cos_sin_cache(max(contexts), q.shape[-1], device=DEVICE)
    ref_cache = (k_cache.clone(), v_cache.clone())
    ref = TorchAttentionBackend().forward_rotary(q.clone(), k.clone(), v, *ref_cache, meta, 0.125, positions, cos_sin)
    got = TritonAttentionBackend().forward_rotary(q, k, v, k_cache, v_cache, meta, 0.125, positions, cos_sin)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(k_cache, ref_cache[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v_cache, ref_cache[1], atol=0, rtol=0)
