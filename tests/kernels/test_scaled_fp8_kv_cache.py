"""Per-layer K/V scales of a float8 cache through every kernel that writes or reads it.

The cache holds K / k_scale and V / v_scale (rounded as without scales); every reader
multiplies them back. Each kernel must equal its torch reference with non-1 scales, the
references must equal attention over the dequantized cache, and explicit scales of 1 must be
bit-identical to no scales.
"""

import pytest
import torch
from kernels_testlib import DEVICE, assert_close, make_paged_batch, poisoned
from test_fp8_kv_cache import fp8_values, to_fp8
from test_rope_decode_attention import assert_caches_equal, fused_step
from test_store_kvcache import make_inputs

from sluiceway_kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    rope_decode_attention,
    rope_decode_attention_ref,
    store_kvcache,
    store_kvcache_ref,
)

K_SCALE, V_SCALE = 0.0371, 0.213  # not powers of two: they change which values round where


def scales(k=K_SCALE, v=V_SCALE, shape=(1,)):
    return (torch.full(shape, k, dtype=torch.float32, device=DEVICE),
            torch.full(shape, v, dtype=torch.float32, device=DEVICE))


def scaled_batch(context, query=None, dtype=torch.float32, **kw):
    """A paged batch whose float8 cache holds its keys and values divided by the scales."""
    batch = make_paged_batch(context, query, dtype=dtype, **kw)
    batch.k_cache, batch.v_cache = to_fp8(batch.k_cache / K_SCALE), to_fp8(batch.v_cache / V_SCALE)
    return batch


def dequantized(batch):
    return batch.k_cache.float() * K_SCALE, batch.v_cache.float() * V_SCALE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_divides_by_the_scale_then_rounds(dtype):
    key, value, k_cache, v_cache, slots = make_inputs(13, 2, 64, 16, 4, dtype, skip_every=4)
    key[1, 0, :3] = torch.tensor([20.0, -17.0, 1e-6], dtype=dtype)  # 20 / 0.0371 = 539: saturates
    k8, v8 = to_fp8(k_cache), to_fp8(v_cache)
    k_ref, v_ref = k8.clone(), v8.clone()
    store_kvcache(key, value, k8, v8, slots, *scales())
    store_kvcache_ref(key, value, k_ref, v_ref, slots, *scales())
    assert torch.equal(fp8_values(k8), fp8_values(k_ref)) and torch.equal(fp8_values(v8), fp8_values(v_ref))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            where = (slot // 16, slot % 16)
            assert torch.equal(fp8_values(k8[where]), fp8_values(to_fp8(key[t].float() / K_SCALE)))
            assert torch.equal(fp8_values(v8[where]), fp8_values(to_fp8(value[t].float() / V_SCALE)))
    slot = int(slots[1])
    assert k8[slot // 16, slot % 16, 0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_multiplies_by_the_scales(dtype, partition_size):
    batch = scaled_batch([1, 15, 17, 70], num_heads=8, num_kv_heads=2, block_size=16, dtype=dtype)
    scale = batch.q.shape[-1] ** -0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    out = paged_decode_attention(*args, out=poisoned(batch.q.shape, dtype), partition_size=partition_size,
                                 k_scale=scales()[0], v_scale=scales()[1])
    ref = paged_decode_attention_ref(batch.q.float(), *args[1:], k_scale=scales()[0], v_scale=scales()[1])
    assert_close(out, ref, dtype)
    k, v = dequantized(batch)  # the reference is attention over the dequantized cache
    assert_close(ref, paged_decode_attention_ref(batch.q.float(), k, v, *args[3:]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_multiplies_by_the_scales(dtype):
    batch = scaled_batch([5, 40, 33], [5, 17, 1], num_heads=4, num_kv_heads=2, block_size=16, dtype=dtype)
    tail = (batch.query_start_loc, batch.context_lens, batch.block_tables, batch.q.shape[-1] ** -0.5,
            batch.max_query_len)
    ks, vs = scales(shape=())
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, *tail, k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention_ref(batch.q.float(), batch.k_cache, batch.v_cache, *tail, k_scale=ks, v_scale=vs)
    assert_close(out, ref, dtype)
    assert_close(ref, paged_prefill_attention_ref(batch.q.float(), *dequantized(batch), *tail), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_decode_stores_and_reads_with_the_scales(dtype):
    batch, _, (q, k, v), slots, positions, cos_sin = fused_step([1, 17, 70], dtype=dtype, fp8=True)
    batch.k_cache, batch.v_cache = to_fp8(batch.k_cache.float() / K_SCALE), to_fp8(batch.v_cache.float() / V_SCALE)
    ref_caches = (batch.k_cache.clone(), batch.v_cache.clone())
    tail = (batch.block_tables, batch.context_lens, slots, positions, cos_sin, q.shape[-1] ** -0.5)
    got = rope_decode_attention(q, k, v, batch.k_cache, batch.v_cache, *tail, partition_size=16,
                                k_scale=scales()[0], v_scale=scales()[1])
    ref = rope_decode_attention_ref(q, k, v, *ref_caches, *tail, k_scale=scales()[0], v_scale=scales()[1])
    assert_close(got, ref, dtype)
    assert_caches_equal((batch.k_cache, batch.v_cache), ref_caches)  # the new K/V stored divided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # tiles scaled element-wise; scales folded
def test_scales_of_one_are_bit_identical_to_none(dtype):
    ones = scales(1.0, 1.0)
    key, value, k_cache, v_cache, slots = make_inputs(9, 2, 64, 16, 3, dtype, skip_every=3)
    plain, scaled = (to_fp8(k_cache), to_fp8(v_cache)), (to_fp8(k_cache), to_fp8(v_cache))
    store_kvcache(key * 40, value, *plain, slots)
    store_kvcache(key * 40, value, *scaled, slots, *ones)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(plain, scaled))

    batch = make_paged_batch([3, 40], [3, 1], num_heads=4, num_kv_heads=2, block_size=16, dtype=dtype)
    batch.k_cache, batch.v_cache = to_fp8(batch.k_cache), to_fp8(batch.v_cache)
    cache = (batch.k_cache, batch.v_cache)
    tail = (batch.query_start_loc, batch.context_lens, batch.block_tables, 0.125, batch.max_query_len)
    assert torch.equal(paged_prefill_attention(batch.q, *cache, *tail),
                       paged_prefill_attention(batch.q, *cache, *tail, k_scale=ones[0], v_scale=ones[1]))
    decode = (batch.q[1:3], *cache, batch.block_tables, batch.context_lens, 0.125)
    for part in (None, 16):
        assert torch.equal(paged_decode_attention(*decode, partition_size=part),
                           paged_decode_attention(*decode, partition_size=part, k_scale=ones[0], v_scale=ones[1]))

    step, _, (q, k, v), slots, positions, cos_sin = fused_step([1, 40], fp8=True, dtype=dtype)
    twin = (step.k_cache.clone(), step.v_cache.clone())
    tail = (step.block_tables, step.context_lens, slots, positions, cos_sin, 0.125)
    assert torch.equal(rope_decode_attention(q, k, v, step.k_cache, step.v_cache, *tail),
                       rope_decode_attention(q, k, v, *twin, *tail, k_scale=ones[0], v_scale=ones[1]))
    assert torch.equal(step.k_cache.view(torch.uint8), twin[0].view(torch.uint8))


def test_bad_scales_name_the_argument():
    key, value, k_cache, v_cache, slots = make_inputs(3, 2, 64, 16, 2, torch.float32)
    k8, v8 = to_fp8(k_cache), to_fp8(v_cache)
    ks, vs = scales()
    with pytest.raises(ValueError, match="k_scale and v_scale go together; got k_scale=Tensor, v_scale=None"):
        store_kvcache(key, value, k8, v8, slots, ks)
    with pytest.raises(ValueError, match=r"v_scale must be one float32 value of shape \(\) or \(1,\); "
                                         r"got torch.float64 \(1,\)"):
        store_kvcache(key, value, k8, v8, slots, ks, vs.double())
    with pytest.raises(ValueError, match=r"k_scale must be one float32 value .* got torch.float32 \(2,\)"):
        store_kvcache_ref(key, value, k8, v8, slots, ks.repeat(2), vs)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to a torch.float8_e4m3fn cache only; the cache "
                                         "is torch.float32"):
        store_kvcache(key, value, k_cache, v_cache, slots, ks, vs)
    batch = scaled_batch([4], num_heads=4, num_kv_heads=2, block_size=16)
    with pytest.raises(ValueError, match="k_scale must be a torch.Tensor, got float"):
        paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                               0.125, k_scale=0.5, v_scale=vs)
