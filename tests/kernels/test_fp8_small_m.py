"""The small-M W8A8 kernel against the fp32 product of its dequantized operands, and with the
RMSNorm after it (and its per-token float8 quantization) against the rms_norm kernel run on
its product."""

import importlib

import pytest
import torch
from kernels_testlib import DEVICE, gpu_test

from sluiceway_kernels.fp8_quant import FP8_DTYPE, per_token_quant_fp8_ref, quantize_rows_ref
from sluiceway_kernels.fp8_small_m import fp8_small_m_matmul, fp8_small_m_matmul_ref
from sluiceway_kernels.rms_norm import rms_norm


def operands(tokens, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen) * 0.02
    q, xs = per_token_quant_fp8_ref(x)
    wq, ws = quantize_rows_ref(w)
    expected = (q.float() * xs) @ (wq.float() * ws[:, None]).t()  # (T, N) fp32
    return [t.to(DEVICE) for t in (q, xs, wq, ws)], expected


@pytest.mark.parametrize("tokens,k,n", [(1, 64, 48), (5, 320, 100), (16, 256, 64)])  # partial K and N tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k,dot", [(1, True), (3, True), (2, False)])
def test_matches_the_dequantized_product(tokens, k, n, bias, split_k, dot):
    """One split, and splits merged by the last program (scales and bias applied once, after the
    merge); tensor-core tiles and fp32 multiply-adds."""
    (q, xs, wq, ws), expected = operands(tokens, k, n)
    b = torch.randn(n).to(DEVICE) if bias else None
    out = fp8_small_m_matmul(q, xs, wq, ws, b, torch.float32, config=(32, 64, 4, 2), split_k=split_k, dot=dot)
    if bias:
        expected = expected + b.cpu()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@gpu_test
@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096)])  # llama3-8b's qkv and down
def test_llama3_8b_shapes_on_the_gpu(tokens, k, n):
    """The float8 tensor-core product, split over K and merged in-kernel, against the fp32
    product of the dequantized operands: fp32 out within summation order (seen 6.6e-6 at most on
    an H100, where cuBLASLt's unit-scale float8 product was off by up to 1.5e-3), bf16 out
    within one rounding of it."""
    (q, xs, wq, ws), expected = operands(tokens, k, n)
    out = fp8_small_m_matmul(q, xs, wq, ws, None, torch.float32)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-4)
    out = fp8_small_m_matmul(q, xs, wq, ws, None, torch.bfloat16)
    torch.testing.assert_close(out.float().cpu(), expected.bfloat16().float(), rtol=2**-7, atol=1e-4)


def assert_same_float8(got, want):
    """float8 rows from inputs that may differ in their last bf16 bit: equal but for a few
    values, each one e4m3 step away."""
    got, want = got.float().cpu(), want.float().cpu()
    differ = got != want
    assert differ.float().mean() < 0.02
    step = want.abs().clamp(min=2**-6) / 8  # e4m3: three mantissa bits
    assert ((got - want).abs() <= step * 1.01)[differ].all()


@pytest.mark.parametrize("tokens,k,n,chunk", [(1, 64, 48, None), (5, 320, 100, None), (3, 256, 100, 32)])
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_the_norm_after_it_is_rms_norms(monkeypatch, tokens, k, n, chunk, quantize, split_k):
    """The RMSNorm (with the residual add) after the product, in the launch: the new residual is
    the kernel's own product plus the residual, bit for bit; the output is rms_norm's over that
    product, quantized per token as rms_norm(quantize=True) quantizes; over one chunk of a row
    and over several."""
    if chunk:
        monkeypatch.setattr(importlib.import_module("sluiceway_kernels.small_m_linear"), "NORM_AFTER_BLOCK", chunk)
    (q, xs, wq, ws), _ = operands(tokens, k, n, seed=4)
    gen = torch.Generator().manual_seed(5)
    residual = torch.randn(tokens, n, generator=gen).bfloat16().to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).bfloat16().to(DEVICE)
    tiles = dict(config=(32, 64, 4, 2), split_k=split_k)
    product = fp8_small_m_matmul(q, xs, wq, ws, None, torch.bfloat16, **tiles)
    got, got_residual = fp8_small_m_matmul(q, xs, wq, ws, None, torch.bfloat16, norm_after=norm_w, eps=1e-5,
                                           residual=residual, quantize=quantize, **tiles)
    want, want_residual = rms_norm(product, norm_w, 1e-5, residual, quantize=quantize)
    assert torch.equal(got_residual, want_residual)
    if quantize:
        (got_q, got_scale), (want_q, want_scale) = got, want
        assert got_q.dtype == FP8_DTYPE and got_scale.shape == (tokens, 1)
        torch.testing.assert_close(got_scale, want_scale, rtol=2**-7, atol=0)
        assert_same_float8(got_q.float() * got_scale, want_q.float() * want_scale)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    ref, ref_residual = fp8_small_m_matmul_ref(q, xs, wq, ws, None, torch.bfloat16, norm_after=norm_w, eps=1e-5,
                                               residual=residual, quantize=quantize)
    torch.testing.assert_close(got_residual.float(), ref_residual.float(), rtol=2**-7, atol=2e-2)


def test_rejects_bad_arguments():
    (q, xs, wq, ws), _ = operands(2, 64, 32)
    with pytest.raises(ValueError, match="at most 16"):
        fp8_small_m_matmul(torch.cat([q.float()] * 9).to(q.dtype), xs, wq, ws, None, torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(5,\); expected \(32,\)"):
        fp8_small_m_matmul(q, xs, wq, ws[:5], None, torch.float32)
    with pytest.raises(ValueError, match=r"x_scale has shape \(1, 1\); expected \(2, 1\)"):
        fp8_small_m_matmul(q, xs[:1], wq, ws, None, torch.float32)
    with pytest.raises(ValueError, match="q has dtype"):  # float rows with scales: either quantized, or no scales
        fp8_small_m_matmul(q.float(), xs, wq, ws, None, torch.float32)
    with pytest.raises(ValueError, match="bias has shape"):
        fp8_small_m_matmul(q, xs, wq, ws, torch.zeros(5, device=DEVICE), torch.float32)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        fp8_small_m_matmul(q, xs, wq.t().contiguous().t(), ws, None, torch.float32)
    with pytest.raises(ValueError, match="go with norm_after"):
        fp8_small_m_matmul(q, xs, wq, ws, None, torch.float32, quantize=True)
    with pytest.raises(ValueError, match="norm_after has shape"):
        fp8_small_m_matmul(q, xs, wq, ws, None, torch.float32, norm_after=torch.ones(5, device=DEVICE))
    with pytest.raises(ValueError, match="residual has shape"):
        fp8_small_m_matmul(q, xs, wq, ws, None, torch.float32, norm_after=torch.ones(32, device=DEVICE),
                           residual=torch.zeros(2, 5, device=DEVICE))


@pytest.mark.parametrize("tokens,k,n", [(1, 320, 100), (5, 4096 + 96, 64), (16, 256, 64)])  # past one row tile
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_rows_quantized_in_the_launch_equal_quantized_before_it(tokens, k, n, split_k, dtype):
    """x float with no scales: the launch quantizes each row as per_token_quant_fp8 does (every
    program finds the same scales), so the product is that of the quantized rows, bit for bit;
    with the norm after it too."""
    from sluiceway_kernels.fp8_quant import per_token_quant_fp8

    gen = torch.Generator().manual_seed(tokens + k)
    x = (torch.randn(tokens, k, generator=gen) * torch.logspace(-2, 2, tokens)[:, None]).to(dtype).to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in quantize_rows_ref(torch.randn(n, k, generator=gen) * 0.02))
    q, xs = per_token_quant_fp8(x)
    config = (32, 64, 4, 2)
    before = fp8_small_m_matmul(q, xs, wq, ws, None, dtype, config=config, split_k=split_k)
    inside = fp8_small_m_matmul(x, None, wq, ws, None, dtype, config=config, split_k=split_k)
    assert torch.equal(inside.cpu(), before.cpu())
    norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).to(DEVICE)
    before = fp8_small_m_matmul(q, xs, wq, ws, None, dtype, config=config, split_k=split_k, norm_after=norm_w,
                                quantize=True)
    inside = fp8_small_m_matmul(x, None, wq, ws, None, dtype, config=config, split_k=split_k, norm_after=norm_w,
                                quantize=True)
    assert torch.equal(inside[0].view(torch.uint8).cpu(), before[0].view(torch.uint8).cpu())
    assert torch.equal(inside[1].cpu(), before[1].cpu())
    # the reference quantizes first too
    ref = fp8_small_m_matmul_ref(x.cpu().float(), None, wq.cpu(), ws.cpu(), None, torch.float32)
    torch.testing.assert_close(ref, fp8_small_m_matmul_ref(*per_token_quant_fp8_ref(x.cpu().float()), wq.cpu(),
                                                           ws.cpu(), None, torch.float32))
