import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE, gpu_test

from sluiceway_kernels import store_kvcache, store_kvcache_ref


def make_inputs(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, skip_every=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # keys and values as strided views of one fused projection output, as the engine has them
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    return key, value, k_cache, v_cache, slots.to(DEVICE)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 80), (3, 128)])
def test_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    key, value, k_cache, v_cache, slots = make_inputs(
        13, num_kv_heads, head_dim, block_size, 40 // block_size + 2, dtype, skip_every=4
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reference_writes_each_slot_and_skips_negative(slot_dtype):
    key, value, k_cache, v_cache, slots = make_inputs(9, 2, 64, 8, 4, torch.float32, skip_every=3)
    slots = slots.to(slot_dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 8, slot % 8] = key[t]
            expected_v[slot // 8, slot % 8] = value[t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    store_kvcache(key, value, before_k, before_v, slots)
    assert torch.equal(before_k, expected_k) and torch.equal(before_v, expected_v)


def test_all_slots_skipped_and_empty_batch():
    key, value, k_cache, v_cache, slots = make_inputs(4, 2, 64, 16, 2, torch.float32)
    before = k_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, before)
    store_kvcache(key[:0], value[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, before)


def test_rejects_bad_arguments():
    key, value, k_cache, v_cache, slots = make_inputs(4, 2, 64, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="dtypes must match"):
        store_kvcache(key.half(), value.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, value, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="slot_mapping has dtype"):
        store_kvcache(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="heads/dim"):
        store_kvcache(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        store_kvcache(key.transpose(1, 2).contiguous().transpose(1, 2), value, k_cache, v_cache, slots)


@gpu_test
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_llama8b_shapes(block_size):
    key, value, k_cache, v_cache, slots = make_inputs(
        4096, 8, 128, block_size, 8192 // block_size * 4, torch.bfloat16, skip_every=7
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@gpu_test
def test_gpu_cuda_graph_replay():
    key, value, k_cache, v_cache, slots = make_inputs(64, 8, 128, 16, 16, torch.bfloat16)
    store_kvcache(key, value, k_cache, v_cache, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kvcache(key, value, k_cache, v_cache, slots)
    new_key, new_value, _, _, new_slots = make_inputs(64, 8, 128, 16, 16, torch.bfloat16, skip_every=5, seed=1)
    key.copy_(new_key)
    value.copy_(new_value)
    slots.copy_(new_slots)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    graph.replay()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_rejects_strided_slot_mapping():
    key, value, k_cache, v_cache, slots = make_inputs(4, 2, 64, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        store_kvcache(key, value, k_cache, v_cache, torch.stack((slots, slots), 1)[:, 0])
