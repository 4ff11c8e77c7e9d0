import pytest
import torch
from kernels_testlib import ALL_DTYPES, DEVICE, HALF_DTYPES, gpu_test, poisoned

from sluiceway_kernels import silu_and_mul, silu_and_mul_ref

TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def close(actual, expected):
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 128), (3, 2 * 1500)])  # one pair; several column blocks
def test_matches_reference(dtype, shape):
    x = (torch.randn(shape) * 4).to(dtype).to(DEVICE)
    out = poisoned((shape[0], shape[1] // 2), dtype)
    assert silu_and_mul(x, out=out) is out
    close(out, silu_and_mul_ref(x))


def test_strided_rows():
    x = torch.randn(4, 300, device=DEVICE)[:, :200]
    close(silu_and_mul(x), silu_and_mul_ref(x.contiguous()))


def test_reference_matches_float64_formula():
    x = torch.randn(6, 40, device=DEVICE) * 5
    gate, up = x[:, :20].double(), x[:, 20:].double()
    torch.testing.assert_close(silu_and_mul_ref(x).double(), gate / (1 + torch.exp(-gate)) * up, atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="out has shape"):
        silu_and_mul(torch.randn(2, 6, device=DEVICE), out=torch.empty(2, 6, device=DEVICE))
    with pytest.raises(ValueError, match="must have 2 dims"):
        silu_and_mul(torch.randn(6, device=DEVICE))


@gpu_test
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_llama8b_intermediate(dtype):
    x = torch.randn(4096, 2 * 14336, device="cuda").to(dtype)
    close(silu_and_mul(x), silu_and_mul_ref(x))
