"""SwiGLU activation: silu(gate) * up over a fused gate|up projection."""

from __future__ import annotations

import torch

from sluiceway_kernels._common import (FLOAT_DTYPES, TL_DTYPES, check_same_device, check_tensor, next_pow2,
                                      pdl_options, tl, triton, wait_for_previous)
from sluiceway_kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, MIN_AMAX, UnscaledProduct, apply_product_scales,
                                         check_unscaled, per_token_quant_fp8_ref)
from sluiceway_kernels.store_kvcache import _round_to_e4m3

# NOTE: up to SPLIT_ROWS rows (decode at small batch) silu_and_mul_fp8 quantizes each row in
# chunks of SPLIT_CHUNK columns, one program each, every program reading the whole row for its
# amax in tiles of up to SPLIT_AMAX_BLOCK columns. On an H100, batch-1 FP8 decode (llama3-8b,
# 2026-12-07, scripts/gpu_small_batch_ab.sh stage fp8silu, two runs each alternating): 4.03 / 4.04
# ms a token against 4.15 / 4.14 with one program a row (its kernel 9.9 -> 6.0 us a layer); with
# gate/up's scales left to it as well, 4.11 / 4.11 (each program then reads the fp32 product and
# its 28,672 column scales). The amax read as one tile of 16,384 columns (16 warps) rather than
# four of 4,096: 3.97 / 3.97 against 4.02 / 4.03 ms (its kernel 5.9 -> 4.0 us a layer; same call)
SPLIT_ROWS = 16
SPLIT_CHUNK = 1024
SPLIT_AMAX_BLOCK = 16384


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inner,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, stride_x, stride_q, inner,
    QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, QBLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # program (row, c): the product of the whole row rounded to the model dtype, its amax, then the
    # float8 values of columns [c * CHUNK, (c + 1) * CHUNK) in tiles of QBLOCK (CHUNK a multiple of
    # it). One chunk a row (CHUNK >= inner) is one program a row; a few rows split each row over
    # programs that all find the same amax, so no program waits for another
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, inner, BLOCK):
        out = _silu_mul_tile(x_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, row, stride_x, start + cols, inner,
                             SCALED, HAS_BIAS, DTYPE)
        amax = tl.maximum(amax, tl.abs(out))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), AMAX_FLOOR), QMAX)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + row, scale)
    qcols = tl.arange(0, QBLOCK)
    for start in range(first, tl.minimum(first + CHUNK, inner), QBLOCK):
        out = _silu_mul_tile(x_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, row, stride_x, start + qcols, inner,
                             SCALED, HAS_BIAS, DTYPE)
        q = _round_to_e4m3(tl.math.div_rn(out, scale), QMAX)
        tl.store(q_ptr + row * stride_q + start + qcols, q.to(q_ptr.dtype.element_ty), mask=start + qcols < inner)


@triton.jit
def _silu_mul_tile(x_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, row, stride_x, cols, inner,
                   SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr):
    """silu(gate) * up at ``cols`` of one row, rounded to ``DTYPE`` and widened to fp32; an
    ``UnscaledProduct``'s gate and up get their scale epilogue first (``SCALED``)."""
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        gate = apply_product_scales(gate, row_scale_ptr, col_scale_ptr, bias_ptr, row, cols, mask, HAS_BIAS, DTYPE)
        up = apply_product_scales(up, row_scale_ptr, col_scale_ptr, bias_ptr, row, inner + cols, mask, HAS_BIAS,
                                  DTYPE)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(DTYPE).to(tl.float32)


def silu_and_mul_fp8(x: torch.Tensor | UnscaledProduct) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_and_mul`, its output (rounded to x's dtype) quantized per row to float8
    e4m3 as ``sluiceway_kernels.fp8_quant.per_token_quant_fp8`` does: ``(q (T, I) float8_e4m3fn,
    scale (T, 1) float32)``, the input of an FP8 down projection. ``x`` may be the gate/up
    projection's ``UnscaledProduct``: its scales are applied as it is loaded, and the result is
    that of ``silu_and_mul_fp8(x.scaled())``, bit for bit, in one launch."""
    product = x if isinstance(x, UnscaledProduct) else None
    if product is not None:
        check_unscaled(product)
        x = product.y
    check_tensor("x", x, 2, FLOAT_DTYPES)
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {width}")
    scales = ({} if product is None else
              dict(row_scale=product.row_scale, col_scale=product.col_scale,
                   **({"bias": product.bias} if product.bias is not None else {})))
    check_same_device(x=x, **scales)
    inner = width // 2
    q = torch.empty((num_rows, inner), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows and inner:
        split = num_rows <= SPLIT_ROWS and inner > SPLIT_CHUNK
        block = min(SPLIT_AMAX_BLOCK if split else 4096, next_pow2(inner))
        chunk = SPLIT_CHUNK if split else -(-inner // block) * block
        row_scale, col_scale, bias = ((product.row_scale, product.col_scale, product.bias) if product is not None
                                      else (scale, scale, None))
        _silu_and_mul_fp8_kernel[(num_rows, -(-inner // chunk))](
            x, q, scale, row_scale, col_scale, bias if bias is not None else scale, x.stride(0), q.stride(0), inner,
            QMAX=FP8_MAX, AMAX_FLOOR=MIN_AMAX, SCALED=product is not None, HAS_BIAS=bias is not None,
            DTYPE=TL_DTYPES[product.dtype if product is not None else x.dtype], BLOCK=block, CHUNK=chunk,
            QBLOCK=min(chunk, block), num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
            **pdl_options(x.device),
        )
    return q, scale


def silu_and_mul_fp8_ref(x: torch.Tensor | UnscaledProduct) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`silu_and_mul_fp8`."""
    return per_token_quant_fp8_ref(silu_and_mul_ref(x.scaled() if isinstance(x, UnscaledProduct) else x))


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for x of shape (T, 2I); computed in fp32.

    Args:
        x: (T, 2I) float, last dim contiguous (rows may be strided).
        out: optional (T, I) of x's dtype, last dim contiguous.

    Returns: ``out``, (T, I).
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {width}")
    inner = width // 2
    if out is None:
        out = torch.empty((num_rows, inner), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, 2, (x.dtype,))
        if tuple(out.shape) != (num_rows, inner):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {(num_rows, inner)}")
    check_same_device(x=x, out=out)
    if num_rows and inner:
        block = min(1024, next_pow2(inner))
        grid = (num_rows, -(-inner // block))
        _silu_and_mul_kernel[grid](
            x, out, x.stride(0), out.stride(0), inner, BLOCK=block, num_warps=4 if block >= 512 else 1,
            **pdl_options(x.device),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch :func:`silu_and_mul`."""
    inner = x.shape[-1] // 2
    result = (torch.nn.functional.silu(x[..., :inner].float()) * x[..., inner:].float()).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
