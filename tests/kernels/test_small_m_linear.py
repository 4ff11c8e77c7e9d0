"""small_m_linear: a few rows' product with RMSNorm (and the residual add) in its prologue and
SwiGLU in its epilogue, against rms_norm, a product and silu_and_mul one after another."""

import pytest
import torch
from kernels_testlib import DEVICE, assert_close, gpu_test, poisoned

from sluiceway_kernels import rms_norm, rms_norm_ref, silu_and_mul_ref
from sluiceway_kernels.small_m_linear import MAX_ROWS, small_m_linear, small_m_linear_ref


def inputs(m, n, inner, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, inner, generator=gen) * 2).to(dtype).to(DEVICE)
    residual = torch.randn(m, inner, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(inner, generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight, norm_weight


FOLDINGS = {  # name -> (norm, residual, silu_mul)
    "plain": (False, False, False),
    "norm": (True, False, False),
    "norm+residual": (True, True, False),
    "silu_mul": (False, False, True),
    "norm+residual+silu_mul": (True, True, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folding", list(FOLDINGS))
@pytest.mark.parametrize("m,n,inner,split_k,dot", [
    (1, 96, 200, 1, True),  # ragged columns and inner dim, one split
    (3, 64, 256, 2, True),  # splits merged by the last to arrive
    (8, 130, 520, 3, True),  # ragged splits
    (1, 96, 200, 2, False),  # multiply-adds over one row
    (3, 64, 256, 3, False),  # over four rows, one of them past M
])
def test_matches_the_unfused_steps(dtype, folding, m, n, inner, split_k, dot):
    norm, with_residual, silu_mul = FOLDINGS[folding]
    x, residual, weight, norm_weight = inputs(m, n, inner, dtype)
    kwargs = dict(norm_weight=norm_weight if norm else None, eps=1e-5,
                  residual=residual if with_residual else None, silu_mul=silu_mul)
    out = poisoned((m, n // 2 if silu_mul else n), dtype)
    got = small_m_linear(x, weight, out=out, config=(32, 32, 4, 2), split_k=split_k, dot=dot, **kwargs)
    want = small_m_linear_ref(x, weight, **kwargs)
    if with_residual:
        (got, got_residual), (want, want_residual) = got, want
        _, kernel_residual = rms_norm(x, norm_weight, 1e-5, residual)
        assert torch.equal(got_residual, kernel_residual)  # the rounded sum, as rms_norm writes it
    assert got is out
    assert_close(got, want)


def test_the_reference_is_the_unfused_steps():
    x, residual, weight, norm_weight = inputs(4, 64, 96, torch.float32)
    normed, new_residual = rms_norm_ref(x, norm_weight, 1e-6, residual)
    want = silu_and_mul_ref(normed @ weight.t())
    got, got_residual = small_m_linear_ref(x, weight, norm_weight, 1e-6, residual, silu_mul=True)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_residual, new_residual)


def test_counters_reset_between_launches_of_every_folding():
    x, residual, weight, norm_weight = inputs(2, 64, 256, torch.float32)
    for silu_mul in (False, True, False):
        got = small_m_linear(x, weight, norm_weight, residual=residual, silu_mul=silu_mul, config=(32, 32, 4, 2),
                             split_k=4)
        want = small_m_linear_ref(x, weight, norm_weight, residual=residual, silu_mul=silu_mul)
        assert_close(got[0], want[0])


def test_rejects_bad_arguments_naming_the_field():
    x, residual, weight, norm_weight = inputs(2, 64, 256, torch.float32)
    with pytest.raises(ValueError, match="weight has 256 columns; expected x's 200"):
        small_m_linear(x[:, :200], weight)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        small_m_linear(x.repeat(MAX_ROWS, 1), weight)
    with pytest.raises(ValueError, match="weight has dtype"):
        small_m_linear(x, weight.half())
    with pytest.raises(ValueError, match="residual goes with norm_weight"):
        small_m_linear(x, weight, residual=residual)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        small_m_linear(x, weight, norm_weight[:10])
    with pytest.raises(ValueError, match="an even count, got 63"):
        small_m_linear(x, weight[:63], silu_mul=True)


@gpu_test
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("shape,folding", [
    ((6144, 4096), "norm+residual"),  # q/k/v after the input norm
    ((4096, 4096), "plain"),  # the output projection
    ((28672, 4096), "norm+residual+silu_mul"),  # gate/up after the post-attention norm
    ((4096, 14336), "plain"),  # the down projection
])
def test_gpu_llama8b_layer(m, shape, folding):
    norm, with_residual, silu_mul = FOLDINGS[folding]
    x, residual, weight, norm_weight = inputs(m, *shape, torch.bfloat16)
    kwargs = dict(norm_weight=norm_weight if norm else None, residual=residual if with_residual else None,
                  silu_mul=silu_mul)
    got, want = small_m_linear(x, weight, **kwargs), small_m_linear_ref(x, weight, **kwargs)
    if with_residual:
        (got, _), (want, _) = got, want
    assert_close(got, want)
