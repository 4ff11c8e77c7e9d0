"""The FP8 quantization kernels against their torch references (bit for bit) and the formula."""

import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE, poisoned

from kernels.fp8_quant import (FP8_DTYPE, per_token_quant_fp8, per_token_quant_fp8_ref, scale_epilogue,
                               scale_epilogue_ref)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 96), (3, 4096 + 904)])  # one chunk; two chunks, the last partial
def test_per_token_quant_matches_reference_bit_for_bit(dtype, shape):
    x = (torch.randn(shape) * torch.logspace(-3, 2, shape[0])[:, None]).to(dtype).to(DEVICE)
    x[0, 0] = 0.0
    q, scale = per_token_quant_fp8(x)
    q_ref, scale_ref = per_token_quant_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (shape[0], 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(_bits(q), _bits(q_ref))
    # each row's largest magnitude lands on 448, and the round trip is within e4m3's step
    assert torch.all(q.float().abs().amax(dim=1) == 448.0)
    back = q.float() * scale
    assert torch.all((back - x.float()).abs() <= x.float().abs() * 2**-4 + scale * 2**-9)


def test_zero_rows_strided_rows_and_given_scales():
    x = torch.randn(4, 300, device=DEVICE)[:, :160]
    x[2] = 0.0
    q, scale = per_token_quant_fp8(x)
    q_ref, scale_ref = per_token_quant_fp8_ref(x.contiguous())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(scale.cpu(), scale_ref.cpu())
    assert torch.all(q[2].float() == 0.0)
    given = scale * 4  # e.g. a row split across ranks whose other half is larger
    q4, same = per_token_quant_fp8(x, given)
    assert same is given
    assert torch.equal(_bits(q4), _bits(per_token_quant_fp8_ref(x, given)[0]))


@pytest.mark.parametrize("out_dtype", ALL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_epilogue_matches_reference(out_dtype, bias):
    y = torch.randn(3, 1500, device=DEVICE) * 100
    rows, cols = torch.rand(3, 1, device=DEVICE), torch.rand(1500, device=DEVICE)
    b = torch.randn(1500, device=DEVICE).to(out_dtype) if bias else None
    out = scale_epilogue(y, rows, cols, b, out_dtype)
    expected = scale_epilogue_ref(y, rows, cols, b, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-6 if out_dtype == torch.float32 else 1e-2,
                               atol=1e-5)
    poison = poisoned((3, 1500), torch.float32)
    assert not torch.isnan(scale_epilogue(poison.nan_to_num(1.0), rows, cols, b, out_dtype)).any()


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="x has dtype"):
        per_token_quant_fp8(torch.zeros(2, 16, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"scale must be a contiguous \(2, 1\) tensor"):
        per_token_quant_fp8(torch.randn(2, 16, device=DEVICE), torch.ones(1, 1, device=DEVICE))
    with pytest.raises(ValueError, match="do not fit"):
        scale_epilogue(torch.randn(2, 8, device=DEVICE), torch.ones(2, 1, device=DEVICE),
                       torch.ones(7, device=DEVICE), None, torch.float32)
