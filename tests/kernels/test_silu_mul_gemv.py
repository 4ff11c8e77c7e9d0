"""The down projection with SwiGLU in its prologue against silu_and_mul then an fp32 product."""

import pytest
import torch
from kernels_testlib import DEVICE, assert_close, gpu_test, poisoned

from sluiceway_kernels.silu_mul_gemv import MAX_ROWS, silu_mul_linear, silu_mul_linear_ref


def inputs(m, n, inner, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(m, 2 * inner, generator=gen) * 2).to(dtype).to(DEVICE)
    weight = (torch.randn(n, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    return gate_up, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,inner,split_k", [
    (1, 100, 200, 1),  # ragged columns and inner dim, one split
    (3, 64, 256, 2),  # splits merged by the last to arrive
    (8, 130, 520, 3),  # ragged splits
    (MAX_ROWS, 32, 64, 1),
])
def test_matches_silu_and_mul_then_product(dtype, m, n, inner, split_k):
    gate_up, weight = inputs(m, n, inner, dtype)
    out = poisoned((m, n), dtype)
    got = silu_mul_linear(gate_up, weight, out=out, config=(32, 32, 4, 2), split_k=split_k)
    assert got is out
    assert_close(got, silu_mul_linear_ref(gate_up, weight))


def test_counters_reset_between_launches():
    gate_up, weight = inputs(2, 64, 256, torch.float32)
    for seed in range(2):
        gate_up.copy_(inputs(2, 64, 256, torch.float32, seed=seed + 1)[0])
        got = silu_mul_linear(gate_up, weight, config=(32, 32, 4, 2), split_k=4)
        assert_close(got, silu_mul_linear_ref(gate_up, weight))


def test_rejects_bad_arguments():
    gate_up, weight = inputs(2, 64, 256, torch.float32)
    with pytest.raises(ValueError, match="expected 2 x weight's 256"):
        silu_mul_linear(gate_up[:, :300], weight)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        silu_mul_linear(gate_up.repeat(MAX_ROWS, 1), weight)
    with pytest.raises(ValueError, match="weight has dtype"):
        silu_mul_linear(gate_up, weight.half())


@gpu_test
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_llama8b_down_projection(m):
    gate_up, weight = inputs(m, 4096, 14336, torch.bfloat16)
    assert_close(silu_mul_linear(gate_up, weight), silu_mul_linear_ref(gate_up, weight))
