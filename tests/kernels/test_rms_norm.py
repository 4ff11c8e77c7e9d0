import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE, HALF_DTYPES, gpu_test

from sluiceway_kernels import rms_norm, rms_norm_ref

# The kernel and the reference round at the same points, so they agree to an ulp or two
# (bf16 ulp: 2**-8 relative; the interpreter also truncates where GPUs round to nearest).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight


def close(actual, expected):
    atol, rtol = TOL[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (2, 3, 128)])  # non-power-of-two width; q/k norm layout
def test_matches_reference(dtype, shape):
    x, residual, weight = inputs(shape, dtype)
    close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out, new_residual = rms_norm(x, weight, 1e-5, residual=residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual=residual)
    close(out, ref_out)
    close(new_residual, ref_residual)  # one rounded add, both sides


def test_strided_rows_and_fp32_weight():
    x, _, _ = inputs((5, 256), torch.bfloat16)
    rows = torch.randn(5, 512, device=DEVICE).to(torch.bfloat16)[:, :256]  # row stride 512
    rows.copy_(x)
    weight = torch.rand(256, device=DEVICE)
    close(rms_norm(rows, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_inputs_are_not_modified():
    x, residual, weight = inputs((4, 96), torch.float16)
    x0, r0 = x.clone(), residual.clone()
    rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_matches_float64_formula(with_residual):
    x, residual, weight = inputs((6, 200), torch.float32)
    got = rms_norm_ref(x, weight, 1e-6, residual=residual if with_residual else None)
    h = (x + residual if with_residual else x).double()
    expected = weight.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close((got[0] if with_residual else got).double(), expected, atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments():
    x, residual, weight = inputs((4, 64), torch.float32)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, weight[:32], 1e-6)
    with pytest.raises(ValueError, match="residual has dtype"):
        rms_norm(x, weight, 1e-6, residual=residual.half())
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(x.t(), weight, 1e-6)
    with pytest.raises(ValueError, match="cannot be viewed as rows"):
        rms_norm(torch.randn(4, 3, 64, device=DEVICE).transpose(0, 1), weight, 1e-6)


@gpu_test
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("hidden", [4096, 8192])
def test_gpu_model_widths(dtype, hidden):
    x, residual, weight = inputs((4096, hidden), dtype)
    close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    out, new_residual = rms_norm(x, weight, 1e-5, residual=residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual=residual)
    close(out, ref_out)
    assert torch.equal(new_residual, ref_residual)  # compiled: both round to nearest even
