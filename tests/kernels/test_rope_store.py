"""rope_store: rotary and the KV-cache store in one launch, bit for bit what the two kernels
(and their references) write."""

import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE

from sluiceway_kernels import apply_rotary, make_cos_sin_cache, store_kvcache
from sluiceway_kernels._common import FP8_KV_DTYPE
from sluiceway_kernels.rope_store import rope_store, rope_store_ref


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype, cache_dtype=None,
                block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q, k and v as strided views of one fused qkv output, as the engine has them
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).mul(3).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    num_blocks = num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens store nothing
    positions = torch.randint(0, 300, (num_tokens,), generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype).to(DEVICE)
    cos_sin = make_cos_sin_cache(300, rotary_dim, device=DEVICE)
    return qkv, q, k, v, k_cache, v_cache, slots.to(DEVICE), positions.to(DEVICE), cos_sin


def two_kernels(q, k, v, k_cache, v_cache, slots, positions, cos_sin, is_neox, **scales):
    k = k.clone()
    apply_rotary(q, k, positions, cos_sin, is_neox)
    store_kvcache(k, v, k_cache, v_cache, slots, **scales)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rotary_dim",
                         [(4, 2, 64, 64), (8, 1, 128, 128), (3, 3, 80, 80), (4, 2, 64, 32)])
def test_writes_what_rotary_then_store_write(dtype, is_neox, num_heads, num_kv_heads, head_dim, rotary_dim):
    """GQA, MQA, a head dim that is no power of two, partial rotary; q rotated in place, the
    cache's slots written (skipping -1), k, v and the fused buffer's v part untouched."""
    qkv, q, k, v, k_cache, v_cache, slots, positions, cos_sin = make_inputs(
        37, num_heads, num_kv_heads, head_dim, rotary_dim, dtype)
    expected = [t.clone() for t in (qkv, k_cache, v_cache)]
    e_qkv = expected[0]
    two_kernels(e_qkv[:, :num_heads], e_qkv[:, num_heads:num_heads + num_kv_heads], e_qkv[:, num_heads + num_kv_heads:],
                expected[1], expected[2], slots, positions, cos_sin, is_neox)
    refs = [t.clone() for t in (qkv, k_cache, v_cache)]
    r_qkv = refs[0]
    rope_store_ref(r_qkv[:, :num_heads], r_qkv[:, num_heads:num_heads + num_kv_heads], r_qkv[:, num_heads + num_kv_heads:],
                   refs[1], refs[2], slots, positions, cos_sin, is_neox)
    rope_store(q, k, v, k_cache, v_cache, slots, positions, cos_sin, is_neox)
    for got, want, ref in zip((qkv, k_cache, v_cache), expected, refs):
        assert torch.equal(got, want)  # the two kernels, bit for bit
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])  # and the references


@pytest.mark.parametrize("scaled", [False, True])
def test_a_float8_cache_is_divided_by_its_scales_and_rounded_as_store_kvcache_does(scaled):
    qkv, q, k, v, k_cache, v_cache, slots, positions, cos_sin = make_inputs(
        21, 4, 2, 64, 64, torch.bfloat16, cache_dtype=FP8_KV_DTYPE)
    scales = dict(k_scale=torch.tensor([0.37], device=DEVICE), v_scale=torch.tensor([2.5], device=DEVICE)) if scaled else {}
    expected = [t.clone() for t in (qkv, k_cache, v_cache)]
    e = expected[0]
    two_kernels(e[:, :4], e[:, 4:6], e[:, 6:], expected[1], expected[2], slots, positions, cos_sin, True, **scales)
    rope_store(q, k, v, k_cache, v_cache, slots, positions, cos_sin, True, **scales)
    assert torch.equal(qkv, expected[0])
    for got, want in zip((k_cache, v_cache), expected[1:]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_no_tokens_and_bad_arguments_name_the_field():
    qkv, q, k, v, k_cache, v_cache, slots, positions, cos_sin = make_inputs(6, 4, 2, 64, 64, torch.float32)
    before = k_cache.clone()
    rope_store(q[:0], k[:0], v[:0], k_cache, v_cache, slots[:0], positions[:0], cos_sin)
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        rope_store(q, k, v, k_cache, v_cache, slots[:3], positions, cos_sin)
    with pytest.raises(ValueError, match="cos_sin_cache width 96"):
        rope_store(q, k, v, k_cache, v_cache, slots, positions, make_cos_sin_cache(300, 96, device=DEVICE))
    with pytest.raises(ValueError, match="q, k and v dtypes differ"):
        rope_store(q, k.half(), v, k_cache, v_cache, slots, positions, cos_sin)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to a"):
        rope_store(q, k, v, k_cache, v_cache, slots, positions, cos_sin,
                   k_scale=torch.ones(1, device=DEVICE), v_scale=torch.ones(1, device=DEVICE))
