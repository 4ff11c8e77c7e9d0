"""An FP8 product's scale epilogue folded into the kernel that reads the product next
(``UnscaledProduct``): RMSNorm (with and without the residual add and per-token quantization)
and SiLU-mul's float8 variant give, bit for bit, what the epilogue kernel followed by the
unfused kernel gives; their references agree with the kernels as the unfused ones do."""

import pytest
import torch
from kernels_testlib import DEVICE, HALF_DTYPES

from sluiceway_kernels.fp8_quant import UnscaledProduct, scale_epilogue
from sluiceway_kernels.rms_norm import rms_norm, rms_norm_ref
from sluiceway_kernels.silu_mul import silu_and_mul_fp8, silu_and_mul_fp8_ref


def product(rows: int, width: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> UnscaledProduct:
    """A product of float8 operands taken with unit scales: integers of a few hundred, as
    sums of e4m3 products are, with per-token and per-channel scales."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(-3000, 3000, (rows, width), generator=gen).float() / 8
    row_scale = torch.rand((rows, 1), generator=gen) * 0.01 + 1e-3
    col_scale = torch.rand(width, generator=gen) * 0.01 + 1e-3
    b = (torch.randn(width, generator=gen) * 0.1).to(dtype).to(DEVICE) if bias else None
    return UnscaledProduct(y.to(DEVICE), row_scale.to(DEVICE), col_scale.to(DEVICE), b, dtype)


def same(actual, expected):
    """Bit for bit: float8 outputs and scales as well as half-precision ones."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            same(a, e)
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.uint8) if actual.element_size() == 1 else actual,
                       expected.view(torch.uint8) if expected.element_size() == 1 else expected)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_applies_the_scales_as_the_epilogue_kernel_does(dtype, residual, quantize, bias):
    p = product(3, 320, dtype, bias)
    weight = (1 + 0.1 * torch.randn(320)).to(dtype).to(DEVICE)
    res = torch.randn(3, 320).to(dtype).to(DEVICE) if residual else None
    unfused = rms_norm(scale_epilogue(p.y, p.row_scale, p.col_scale, p.bias, dtype), weight, 1e-5, res, quantize)
    same(rms_norm(p, weight, 1e-5, res, quantize), unfused)
    # the reference takes an UnscaledProduct as it takes the scaled product
    same(rms_norm_ref(p, weight, 1e-5, res, quantize), rms_norm_ref(p.scaled(), weight, 1e-5, res, quantize))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inner", [64, 1500])  # one column block; several, and a ragged last one
def test_silu_mul_fp8_applies_the_scales_as_the_epilogue_kernel_does(dtype, bias, inner):
    p = product(2, 2 * inner, dtype, bias, seed=1)
    unfused = silu_and_mul_fp8(scale_epilogue(p.y, p.row_scale, p.col_scale, p.bias, dtype))
    same(silu_and_mul_fp8(p), unfused)
    same(silu_and_mul_fp8_ref(p), silu_and_mul_fp8_ref(p.scaled()))


def test_a_product_whose_scales_do_not_fit_is_refused_by_name():
    p = product(2, 64, torch.bfloat16, False)
    with pytest.raises(ValueError, match="col_scale"):
        rms_norm(p._replace(col_scale=p.col_scale[:10]), torch.ones(64, dtype=torch.bfloat16, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="y has dtype torch.bfloat16; expected one of float32"):
        silu_and_mul_fp8(p._replace(y=p.y.to(torch.bfloat16)))
