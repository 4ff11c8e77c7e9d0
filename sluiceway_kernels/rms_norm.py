"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from sluiceway_kernels._common import (FLOAT_DTYPES, TL_DTYPES, check_same_device, check_shape, check_tensor,
                                      next_pow2, pdl_options, tl, triton, wait_for_previous)
from sluiceway_kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, MIN_AMAX, UnscaledProduct, apply_product_scales,
                                         check_unscaled, per_token_quant_fp8_ref)
from sluiceway_kernels.store_kvcache import _round_to_e4m3

# NOTE: the warps of a row's program; None: one per 512 columns (8 for a 4,096-wide row), up to 16.
# A setting for the A/B of a row's latency at batch 1 (stage fp8tune of scripts/gpu_small_batch_ab.sh)
NUM_WARPS: int | None = None


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, row_scale_ptr, col_scale_ptr, bias_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:  # x is an UnscaledProduct's y: its scale epilogue first, rounded to the model dtype
        xf = apply_product_scales(xf, row_scale_ptr, col_scale_ptr, bias_ptr, row, cols, mask, HAS_BIAS, DTYPE)
    if HAS_RESIDUAL:
        # One add rounded to the model dtype, as the unfused model does; the statistics then
        # see the rounded sum that the next layer's residual will hold.
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (xf + r).to(DTYPE)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    # NOTE: round the normalised value to the model dtype before the weight, as HF Llama/Qwen do.
    normed = (xf * rstd).to(DTYPE).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (normed * w).to(DTYPE)
    if QUANT:  # the rounded output, quantized per token to float8 (sluiceway_kernels/fp8_quant.py's rule)
        outf = out.to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(outf), 0), AMAX_FLOOR), QMAX)
        tl.store(scale_ptr + row, scale)
        out = _round_to_e4m3(tl.math.div_rn(outf, scale), QMAX)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} with strides {t.stride()} cannot be viewed as rows; make it contiguous") from None


def rms_norm(
    x: torch.Tensor | UnscaledProduct,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quantize: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: ``weight * x / sqrt(mean(x**2) + eps)``.

    Args:
        x: (..., H), any float dtype; the last dim must be contiguous and the leading dims
            must flatten to one row dim without a copy (any 2-D view qualifies). Or an
            ``UnscaledProduct`` (T, H) whose scales the kernel applies as it loads it: the
            result is that of ``rms_norm(x.scaled(), ...)``, bit for bit, in one launch.
        weight: (H,), any float dtype.
        eps: added to the mean square.
        residual: optional, x's shape and dtype. With it the op is the fused pre-norm step:
            ``new_residual = x + residual`` (rounded to x's dtype), ``out = rmsnorm(new_residual)``.
        quantize: ``out`` becomes ``(q, scale)``: the output rounded to x's dtype, then
            quantized per row to float8 e4m3 as ``sluiceway_kernels.fp8_quant.per_token_quant_fp8`` does
            (q: x's shape, float8_e4m3fn; scale: (rows, 1) float32), for an FP8 linear layer.

    Returns: ``out`` (x's shape and dtype), or ``(out, new_residual)``. Statistics in fp32.
    """
    product = x if isinstance(x, UnscaledProduct) else None
    if product is not None:
        check_unscaled(product)
        x = product.y
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor with at least one dim")
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    dtype = product.dtype if product is not None else x.dtype  # the model's
    hidden = x.shape[-1]
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_shape("weight", weight, (hidden,))
    rows = _as_rows("x", x)
    out = torch.empty(x.shape, dtype=FP8_DTYPE if quantize else dtype, device=x.device)
    scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=x.device) if quantize else weight
    tensors = dict(x=x, weight=weight)
    if product is not None:
        tensors.update(row_scale=product.row_scale, col_scale=product.col_scale,
                       **({"bias": product.bias} if product.bias is not None else {}))
    if residual is not None:
        check_tensor("residual", residual, x.dim(), (dtype,))
        check_shape("residual", residual, x.shape)
        tensors["residual"] = residual
        residual_rows = _as_rows("residual", residual)
        residual_out = torch.empty(x.shape, dtype=dtype, device=x.device)
    else:
        residual_rows = residual_out = rows
    check_same_device(**tensors)
    num_rows = rows.shape[0]
    if num_rows:
        block = next_pow2(hidden)
        num_warps = NUM_WARPS or min(16, max(1, block // 512))
        row_scale, col_scale, bias = ((product.row_scale, product.col_scale, product.bias) if product is not None
                                      else (weight, weight, None))
        _rms_norm_kernel[(num_rows,)](
            rows, residual_rows, weight, out, residual_out, scale, row_scale, col_scale,
            bias if bias is not None else weight,
            rows.stride(0), residual_rows.stride(0), hidden, hidden,
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, QUANT=quantize, QMAX=FP8_MAX, AMAX_FLOOR=MIN_AMAX,
            SCALED=product is not None, HAS_BIAS=bias is not None, DTYPE=TL_DTYPES[dtype],
            BLOCK=block, num_warps=num_warps, **pdl_options(x.device),
        )
    if quantize:
        out = (out, scale)
    return out if residual is None else (out, residual_out)


def rms_norm_ref(
    x: torch.Tensor | UnscaledProduct,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quantize: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`rms_norm`, same arguments and results."""
    if isinstance(x, UnscaledProduct):
        x = x.scaled()
    if residual is not None:
        x = x + residual  # rounded to the model dtype, as the kernel stores it
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
    if quantize:
        out = per_token_quant_fp8_ref(out)
    return out if residual is None else (out, x)
