"""A float8 (e4m3) KV cache through the store and attention kernels.

The store must round as torch's own conversion does (after clamping to +-448); attention
over a float8 cache must equal the reference computed on the same cache widened to fp32.
"""

import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE, assert_close, gpu_test, make_paged_batch, poisoned
from test_store_kvcache import make_inputs

from sluiceway_kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    store_kvcache,
    store_kvcache_ref,
)
from sluiceway_kernels._common import FP8_KV_DTYPE, interpreting


def to_fp8(cache: torch.Tensor) -> torch.Tensor:
    """A cache converted as the store converts: clamped to the format's largest finite value,
    rounded to nearest (NaN stays NaN)."""
    top = torch.finfo(FP8_KV_DTYPE).max
    return cache.float().clamp(-top, top).to(FP8_KV_DTYPE)


def fp8_values(cache: torch.Tensor) -> torch.Tensor:
    """As fp32 on the CPU, NaN as a number (so it compares equal to itself); -0 equals +0."""
    return cache.float().cpu().nan_to_num(nan=12345.0)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (1, 3, 128), (64, 1, 80)])
def test_store_rounds_as_torch_and_saturates(dtype, block_size, num_kv_heads, head_dim):
    key, value, k_cache, v_cache, slots = make_inputs(
        13, num_kv_heads, head_dim, block_size, 40 // block_size + 2, dtype, skip_every=4
    )
    key, value = key * 3, value / 7  # spread over the exponents
    # token 1 is stored (every 4th from 0 is skipped): beyond the range, at it, infinite, zero, tiny, NaN
    assert slots[1] >= 0
    special = [1000.0, -1000.0, 448.0, float("inf"), float("-inf"), -0.0, 1e-3]
    if not interpreting():  # NOTE: the interpreter's own fp32 -> float8 conversion turns NaN into 384
        special.append(float("nan"))
    key[1, 0, : len(special)] = torch.tensor(special, dtype=dtype)
    k8, v8 = to_fp8(k_cache), to_fp8(v_cache)
    k_ref, v_ref = k8.clone(), v8.clone()
    store_kvcache(key, value, k8, v8, slots)
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(fp8_values(k8), fp8_values(k_ref)) and torch.equal(fp8_values(v8), fp8_values(v_ref))
    # and the reference is torch's conversion of each written row, clamped
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(fp8_values(k8[slot // block_size, slot % block_size]), fp8_values(to_fp8(key[t])))
    slot = int(slots[1])
    written = k8[slot // block_size, slot % block_size, 0, : len(special)].float().cpu()
    assert written[:7].tolist() == [448.0, -448.0, 448.0, 448.0, -448.0, 0.0, 0.001953125]  # 1e-3 -> 2^-9
    assert len(special) == 7 or written[7].isnan()  # a NaN key stays NaN: no finite value stands in for it


def fp8_batch(dtype, context, query=None, **kw):
    batch = make_paged_batch(context, query, dtype=dtype, **kw)
    batch.k_cache, batch.v_cache = to_fp8(batch.k_cache), to_fp8(batch.v_cache)
    return batch


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_over_a_float8_cache(dtype, partition_size):
    batch = fp8_batch(dtype, [1, 15, 16, 17, 70], num_heads=8, num_kv_heads=2, block_size=16)
    scale = batch.q.shape[-1] ** -0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    out = paged_decode_attention(*args, out=poisoned(batch.q.shape, dtype), partition_size=partition_size)
    wide = (batch.q, batch.k_cache.float(), batch.v_cache.float(), batch.block_tables, batch.context_lens, scale)
    ref = paged_decode_attention_ref(batch.q.float(), *wide[1:])
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    assert_close(paged_decode_attention_ref(*args), ref, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_prefill_over_a_float8_cache(dtype):
    context, query = [5, 16, 40, 33], [5, 3, 17, 1]
    batch = fp8_batch(dtype, context, query, num_heads=4, num_kv_heads=2, block_size=16)
    scale = batch.q.shape[-1] ** -0.5
    tail = (batch.query_start_loc, batch.context_lens, batch.block_tables, scale, batch.max_query_len)
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, *tail)
    ref = paged_prefill_attention_ref(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), *tail)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


def test_mismatched_caches_are_refused():
    batch = fp8_batch(torch.float32, [4], num_heads=4, num_kv_heads=2, block_size=16)
    scale = 0.125
    with pytest.raises(ValueError, match="k_cache and v_cache must both"):
        paged_decode_attention(batch.q, batch.k_cache, batch.v_cache.float(), batch.block_tables,
                               batch.context_lens, scale)
    with pytest.raises(ValueError, match="k_cache and v_cache must both"):
        paged_decode_attention(batch.q.half(), batch.k_cache.float(), batch.v_cache.float(), batch.block_tables,
                               batch.context_lens, scale)
    key, value, k_cache, v_cache, slots = make_inputs(3, 2, 64, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="dtypes must match"):
        store_kvcache(key, value, to_fp8(k_cache), v_cache, slots)


@gpu_test
def test_gpu_llama8b_decode_batch_over_a_float8_cache():
    """llama3-8b's head layout (32 query heads on 8 KV heads, head dim 128) in bf16, 64 sequences."""
    lens = [int(x) for x in torch.randint(1, 900, (64,), generator=torch.Generator().manual_seed(2))]
    batch = fp8_batch(torch.bfloat16, lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    scale = 128 ** -0.5
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                                 scale)
    ref = paged_decode_attention_ref(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(),
                                     batch.block_tables, batch.context_lens, scale)
    assert_close(out, ref, torch.bfloat16)
    assert DEVICE.type == "cuda"
