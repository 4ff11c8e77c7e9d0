import math

import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE, HALF_DTYPES, gpu_test

from sluiceway_kernels import apply_rotary, apply_rotary_ref, make_cos_sin_cache

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def qk_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q and k as strided views of one fused qkv output, as the engine has them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return qkv, qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]


def run_both(num_heads, num_kv_heads, head_dim, rotary_dim, is_neox, dtype, max_pos=200):
    qkv, q, k = qk_views(9, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.randint(0, max_pos, (9,), device=DEVICE)
    cache = make_cos_sin_cache(max_pos, rotary_dim, device=DEVICE)
    expected = qkv.clone()
    apply_rotary_ref(
        expected[:, :num_heads], expected[:, num_heads : num_heads + num_kv_heads], positions, cache, is_neox
    )
    apply_rotary(q, k, positions, cache, is_neox)
    return qkv, expected


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,rotary_dim",
    [(4, 2, 64, 64), (8, 1, 128, 128), (3, 3, 80, 80), (4, 2, 64, 32)],  # GQA, MQA, odd half, partial
)
def test_matches_reference(dtype, is_neox, num_heads, num_kv_heads, head_dim, rotary_dim):
    got, expected = run_both(num_heads, num_kv_heads, head_dim, rotary_dim, is_neox, dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    # the v part of the fused buffer, and the unrotated tail of partial rotary, are untouched
    assert torch.equal(got[:, -num_kv_heads:], expected[:, -num_kv_heads:])


def test_reference_matches_complex_rotation():
    _, q, k = qk_views(5, 2, 1, 16, torch.float64)
    positions = torch.tensor([0, 1, 7, 50, 99], device=DEVICE)
    cache = make_cos_sin_cache(100, 16, base=500.0, device=DEVICE)
    for is_neox in (True, False):
        q_ref, k_ref = q.clone(), k.clone()
        apply_rotary_ref(q_ref, k_ref, positions, cache, is_neox)
        freqs = 500.0 ** -(torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        turn = torch.polar(torch.ones(5, 8, dtype=torch.float64), positions.cpu().double()[:, None] * freqs)  # (T, 8)
        for x, got in ((q, q_ref), (k, k_ref)):
            x = x.cpu()
            pairs = torch.complex(x[..., :8], x[..., 8:]) if is_neox else torch.complex(x[..., 0::2], x[..., 1::2])
            rotated = pairs * turn[:, None, :]
            expected = (
                torch.cat((rotated.real, rotated.imag), -1)
                if is_neox
                else torch.stack((rotated.real, rotated.imag), -1).flatten(-2)
            )
            torch.testing.assert_close(got.cpu(), expected, atol=1e-6, rtol=1e-6)


def test_reference_matches_hf_rotate_half():
    _, q, k = qk_views(6, 4, 2, 32, torch.float32)
    positions = torch.arange(6, device=DEVICE) * 3
    cache = make_cos_sin_cache(32, 32, device=DEVICE)
    cos = torch.cat((cache[positions, :16], cache[positions, :16]), -1)[:, None]  # (T, 1, D), HF layout
    sin = torch.cat((cache[positions, 16:], cache[positions, 16:]), -1)[:, None]
    rotate_half = lambda x: torch.cat((-x[..., 16:], x[..., :16]), -1)  # noqa: E731
    expected_q, expected_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    apply_rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)


def test_cos_sin_cache_values():
    cache = make_cos_sin_cache(10, 8, base=10000.0)
    assert cache.shape == (10, 8) and cache.dtype == torch.float32
    assert math.isclose(cache[3, 1].item(), math.cos(3 * 10000 ** (-2 / 8)), rel_tol=1e-6)
    assert math.isclose(cache[3, 5].item(), math.sin(3 * 10000 ** (-2 / 8)), rel_tol=1e-6)


def test_rejects_bad_arguments():
    _, q, k = qk_views(4, 4, 2, 64, torch.float32)
    positions = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="width 66"):
        apply_rotary(q, k, positions, make_cos_sin_cache(8, 66, device=DEVICE))
    with pytest.raises(ValueError, match="positions has shape"):
        apply_rotary(q, k, positions[:3], make_cos_sin_cache(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match="dtypes differ"):
        apply_rotary(q, k.half(), positions, make_cos_sin_cache(8, 64, device=DEVICE))


@gpu_test
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_llama8b_shapes(dtype):
    qkv, q, k = qk_views(8192, 32, 8, 128, dtype)
    positions = torch.randint(0, 8192, (8192,), device="cuda")
    cache = make_cos_sin_cache(8192, 128, base=500000.0, device="cuda")
    expected = qkv.clone()
    apply_rotary_ref(expected[:, :32], expected[:, 32:40], positions, cache)
    apply_rotary(q, k, positions, cache)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv.float(), expected.float(), atol=atol, rtol=rtol)
