"""FP8 (float8 e4m3) quantization for W8A8 linear layers: activations per token, and the
scale epilogue of a product taken with unit scales.

The scale of a row is ``max(|row|) / 448`` (448: e4m3's largest finite value), so the row's
largest element lands on 448; values are divided by it, clamped and rounded to nearest
even. The divisions are IEEE (``div_rn``) so the kernel and the reference round alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sluiceway_kernels._common import (FLOAT_DTYPES, check_same_device, check_tensor, next_pow2, pdl_options, tl,
                                      triton, wait_for_previous)
from sluiceway_kernels.store_kvcache import _round_to_e4m3

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# NOTE: an all-zero row would get scale 0 and 0/0 values; its amax is raised to this, which
# leaves it all zeros and keeps every real activation's scale untouched.
MIN_AMAX = 1e-12
# the two as constexprs, for Triton functions that other kernels call (row_scales, quantized_tile)
QMAX = tl.constexpr(FP8_MAX)
AMAX_FLOOR = tl.constexpr(MIN_AMAX)


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, width,
    QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, GIVEN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if GIVEN_SCALE:
        scale = tl.load(scale_ptr + row)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, width, BLOCK):
            mask = start + cols < width
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), AMAX_FLOOR), QMAX)
        tl.store(scale_ptr + row, scale)
    for start in range(0, width, BLOCK):
        mask = start + cols < width
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        # rounded before the conversion, which the interpreter truncates (see _round_to_e4m3)
        q = _round_to_e4m3(tl.math.div_rn(x, scale), QMAX)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_scales(x_ptr, stride_xm, M, K, BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr):
    """The float8 scale of each of the M rows of x (BLOCK_M,) as per_token_quant_fp8 finds it, the
    row's largest magnitude over 448 (rows past M: the floor's), for a kernel that quantizes its
    input as it loads it (small_m_linear's X_QUANT)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_X)
    amax = tl.zeros((BLOCK_M,), tl.float32)
    for m in range(0, M):
        row_amax = tl.zeros((BLOCK_X,), tl.float32)
        for k0 in range(0, K, BLOCK_X):
            k = k0 + cols
            v = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            row_amax = tl.maximum(row_amax, tl.abs(v))
        amax = tl.where(rows == m, tl.max(row_amax, 0), amax)
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), QMAX)


@triton.jit
def quantized_tile(a, x_scale):
    """Rows of x (BLOCK_M, BLOCK_K) as per_token_quant_fp8 quantizes them with their scales."""
    scale = tl.broadcast_to(x_scale[:, None], a.shape)
    return _round_to_e4m3(tl.math.div_rn(a.to(tl.float32), scale), QMAX).to(tl.float8e4nv)


def per_token_quant_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to float8 e4m3 with its own scale.

    Args:
        x: (T, K) float32 / float16 / bfloat16, last dim contiguous (rows may be strided).
        scale: optional (T, 1) float32 contiguous: the rows' scales, given (e.g. taken over
            a row split across ranks) instead of computed.

    Returns: ``(q, scale)``: q (T, K) float8_e4m3fn contiguous, scale (T, 1) float32, with
    ``q * scale ~ x`` (``scale = max|x_row| / 448``).
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_same_device(x=x)
    num_rows, width = x.shape
    q = torch.empty((num_rows, width), dtype=FP8_DTYPE, device=x.device)
    given = scale is not None
    if given:
        check_tensor("scale", scale, 2, (torch.float32,))
        if tuple(scale.shape) != (num_rows, 1) or not scale.is_contiguous():
            raise ValueError(f"scale must be a contiguous ({num_rows}, 1) tensor, got {tuple(scale.shape)}")
        check_same_device(x=x, scale=scale)
    else:
        scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows and width:
        block = min(4096, next_pow2(width))
        _per_token_quant_kernel[(num_rows,)](
            x, q, scale, x.stride(0), q.stride(0), width, QMAX=FP8_MAX, AMAX_FLOOR=MIN_AMAX, GIVEN_SCALE=given, BLOCK=block,
            num_warps=8 if block >= 2048 else 4, **pdl_options(x.device),
        )
    return q, scale


def per_token_quant_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`per_token_quant_fp8` (any leading dims: rows are the last dim)."""
    xf = x.float()
    if scale is None:
        scale = scale_of_amax(xf.abs().amax(dim=-1, keepdim=True))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """The scale of rows whose largest magnitude is ``amax`` (float32)."""
    amax = amax.float().clamp(min=MIN_AMAX)
    # NOTE: divided by a tensor, not a Python number: CUDA torch multiplies by the
    # reciprocal of a scalar divisor, which rounds differently from the kernel's IEEE division
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (N, K) per output channel: ``(q (N, K) float8, scale (N,) float32)``."""
    q, scale = per_token_quant_fp8_ref(w)
    return q, scale.view(-1)


@triton.jit
def _scale_epilogue_kernel(
    y_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, stride_y, stride_o, width,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    out = y * tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_epilogue(
    y: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(y * row_scale * col_scale + bias).to(out_dtype)`` in fp32: the scales of a product
    of float8 operands taken with unit scales.

    Args:
        y: (M, N) float32, the unscaled product ``q_x @ q_w^T``; last dim contiguous.
        row_scale: (M, 1) float32, one scale per token.
        col_scale: (N,) float32, one scale per output channel.
        bias: optional (N,) float.
        out_dtype: float32, float16 or bfloat16.
    """
    check_tensor("y", y, 2, (torch.float32,))
    num_rows, width = y.shape
    check_tensor("row_scale", row_scale, 2, (torch.float32,))
    check_tensor("col_scale", col_scale, 1, (torch.float32,))
    if tuple(row_scale.shape) != (num_rows, 1) or tuple(col_scale.shape) != (width,):
        raise ValueError(f"row_scale {tuple(row_scale.shape)} / col_scale {tuple(col_scale.shape)} do not fit "
                         f"y {tuple(y.shape)}: expected ({num_rows}, 1) and ({width},)")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    tensors = dict(y=y, row_scale=row_scale, col_scale=col_scale)
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
        tensors["bias"] = bias
    check_same_device(**tensors)
    out = torch.empty((num_rows, width), dtype=out_dtype, device=y.device)
    if num_rows and width:
        block = min(1024, next_pow2(width))
        _scale_epilogue_kernel[(num_rows, -(-width // block))](
            y, row_scale, col_scale, bias if bias is not None else col_scale, out, y.stride(0), out.stride(0), width,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_options(y.device),
        )
    return out


class UnscaledProduct(NamedTuple):
    """A float8 product taken with unit scales whose scale epilogue is left to the kernel that
    reads it next (``rms_norm``, ``silu_and_mul_fp8``): the product is
    ``scale_epilogue(y, row_scale, col_scale, bias, dtype)``, computed by that kernel as it loads
    ``y``, with the same rounding; one launch and one round trip of the product fewer."""

    y: torch.Tensor  # (M, N) float32, last dim contiguous
    row_scale: torch.Tensor  # (M, 1) float32
    col_scale: torch.Tensor  # (N,) float32
    bias: torch.Tensor | None  # (N,) or None
    dtype: torch.dtype  # the product's dtype once scaled (the model's)

    @property
    def shape(self) -> torch.Size:
        return self.y.shape

    @property
    def is_cuda(self) -> bool:
        return self.y.is_cuda

    def scaled(self) -> torch.Tensor:
        """The product with its scales applied (the epilogue's kernel, or its reference off a GPU)."""
        op = scale_epilogue if self.y.is_cuda else scale_epilogue_ref
        return op(self.y, self.row_scale, self.col_scale, self.bias, self.dtype)


def check_unscaled(p: UnscaledProduct) -> None:
    """The shapes and dtypes of ``p`` (what the kernels that apply its scales need)."""
    check_tensor("y", p.y, 2, (torch.float32,))
    check_tensor("row_scale", p.row_scale, 2, (torch.float32,))
    check_tensor("col_scale", p.col_scale, 1, (torch.float32,))
    rows, width = p.y.shape
    if tuple(p.row_scale.shape) != (rows, 1) or tuple(p.col_scale.shape) != (width,):
        raise ValueError(f"row_scale {tuple(p.row_scale.shape)} / col_scale {tuple(p.col_scale.shape)} do not fit "
                         f"y {tuple(p.y.shape)}: expected ({rows}, 1) and ({width},)")
    if p.bias is not None:
        check_tensor("bias", p.bias, 1, FLOAT_DTYPES)
        if tuple(p.bias.shape) != (width,):
            raise ValueError(f"bias has shape {tuple(p.bias.shape)}; expected ({width},)")
    if p.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {p.dtype}")


@triton.jit
def apply_product_scales(y, row_scale_ptr, col_scale_ptr, bias_ptr, row, cols, mask, HAS_BIAS: tl.constexpr,
                         DTYPE: tl.constexpr):
    """An ``UnscaledProduct``'s tile ``y`` (fp32) scaled as ``_scale_epilogue_kernel`` does, rounded
    to ``DTYPE`` and widened back to fp32."""
    out = y * tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return out.to(DTYPE).to(tl.float32)


def scale_epilogue_ref(
    y: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Plain-torch :func:`scale_epilogue`."""
    out = y.float() * row_scale.float() * col_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
