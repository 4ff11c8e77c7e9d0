"""W8A8 product for a few tokens (decode at small batch): float8 activations (T, K) with
per-token scales times float8 weights (N, K) with per-channel scales, both scales and the bias
applied before the one rounding to the output's dtype, in one launch.

At 1-64 tokens cuBLASLt's rowwise-scaled float8 product runs no faster than bf16, and its
unit-scale one needs a second kernel for the scales (docs/BENCHMARKS.md). This is
``small_m_linear``'s kernel over float8 operands: the weight is read once, split over (output
column block, inner-dim split) programs, and the last program of a column block to finish sums
the splits and applies the scales (an arrival counter), so no reduce or epilogue kernel follows.
With ``norm_after`` the RMSNorm that reads the product (and the residual add before it) runs in
the same launch, and with ``quantize`` its output leaves quantized per token for the next FP8
product, as ``rms_norm(quantize=True)`` leaves it.
"""

from __future__ import annotations

import torch

from typing import Any

from sluiceway_kernels._common import FLOAT_DTYPES, check_same_device, check_shape, check_tensor
from sluiceway_kernels.fp8_quant import FP8_DTYPE, per_token_quant_fp8_ref
from sluiceway_kernels.rms_norm import rms_norm_ref
from sluiceway_kernels.small_m_linear import MAX_ROWS, _launch

MAX_TOKENS = MAX_ROWS  # one BLOCK_M tile
# (BLOCK_N output columns, BLOCK_K inner dims per step, num_warps, num_stages): the fastest of
# seven tile configs at 1 and 8 tokens in scripts/fp8_gemm_probe.py (one llama3-8b layer's four
# products in a CUDA graph, an H100: 91.4 us at one token against 96.3 for 64 x 256 x 4 x 4 and
# 93.8 for cuBLASLt plus the scale epilogue; 2026-12-06)
CONFIG = (64, 128, 4, 6)


def fp8_small_m_matmul(
    q: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, config: tuple[int, int, int, int] | None = None,
    split_k: int | None = None, dot: bool = True, norm_after: torch.Tensor | None = None, eps: float = 1e-6,
    residual: torch.Tensor | None = None, quantize: bool = False,
) -> Any:
    """``(q * x_scale) @ (weight * weight_scale[:, None])^T + bias``, accumulated in fp32, for
    up to MAX_TOKENS tokens.

    Args:
        q: (T, K) float8_e4m3fn, T <= MAX_TOKENS, last dim contiguous; x_scale: (T, 1) float32,
            contiguous. Or q float (T, K) with x_scale None: the launch quantizes it per token
            as ``per_token_quant_fp8`` would (the same float8 values and scales) before the product.
        weight: (N, K) float8_e4m3fn, contiguous; weight_scale: (N,) float32, contiguous.
        bias: optional (N,) float. out_dtype: float32, float16 or bfloat16.
        config, split_k, dot: override the tiles, the inner-dim split and the tensor-core
            product (tests, probes), as for ``small_m_linear``.
        norm_after: (N,) float: the output is ``rms_norm(product, norm_after, eps, residual)``.
        residual: (T, N) of ``out_dtype``, with ``norm_after`` only.
        quantize: with ``norm_after``, that output quantized per token: ``(q (T, N) float8, scale
            (T, 1) float32)`` as ``rms_norm(..., quantize=True)`` gives it.

    Returns: (T, N) of ``out_dtype`` (or the quantized pair), and with a residual the pair
    ``(output, new_residual)``. No host synchronisation: it can be captured in a CUDA graph once
    it has run outside one.
    """
    x_quant = x_scale is None  # q is float: quantized per token in the launch
    check_tensor("q", q, 2, FLOAT_DTYPES if x_quant else (FP8_DTYPE,))
    check_tensor("weight", weight, 2, (FP8_DTYPE,))
    num_tokens, k = q.shape
    n = weight.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"q has {num_tokens} tokens; this kernel takes at most {MAX_TOKENS}")
    if weight.shape[1] != k:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (N, {k})")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    check_tensor("weight_scale", weight_scale, 1, (torch.float32,))
    if x_quant:
        x_scale = weight_scale  # a placeholder: the launch finds the rows' scales
    else:
        check_tensor("x_scale", x_scale, 2, (torch.float32,))
        if tuple(x_scale.shape) != (num_tokens, 1):
            raise ValueError(f"x_scale has shape {tuple(x_scale.shape)}; expected ({num_tokens}, 1)")
    if tuple(weight_scale.shape) != (n,):
        raise ValueError(f"weight_scale has shape {tuple(weight_scale.shape)}; expected ({n},)")
    if not (x_scale.is_contiguous() and weight_scale.is_contiguous()):
        raise ValueError("x_scale and weight_scale must be contiguous")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    tensors = dict(q=q, x_scale=x_scale, weight=weight, weight_scale=weight_scale)
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
        tensors["bias"] = bias
    if norm_after is not None:
        check_tensor("norm_after", norm_after, 1, FLOAT_DTYPES)
        check_shape("norm_after", norm_after, (n,))
        tensors["norm_after"] = norm_after
    elif residual is not None or quantize:
        raise ValueError("residual and quantize go with norm_after: they are the norm's")
    if residual is not None:
        check_tensor("residual", residual, 2, (out_dtype,))
        check_shape("residual", residual, (num_tokens, n))
        tensors["residual"] = residual
    check_same_device(**tensors)
    out = torch.empty((num_tokens, n), dtype=out_dtype, device=q.device)
    new_residual = torch.empty_like(out) if residual is not None else None
    quantized = (torch.empty((num_tokens, n), dtype=FP8_DTYPE, device=q.device),
                 torch.empty((num_tokens, 1), dtype=torch.float32, device=q.device)) if quantize else None
    if num_tokens and n:
        _launch(q, weight, out, config or CONFIG, split_k, dot, scales=(x_scale, weight_scale, bias),
                name="fp8_small_m", norm_after=norm_after, eps=eps, residual=residual, new_residual=new_residual,
                quantized=quantized, x_quant=x_quant)
    result = quantized or out
    return result if residual is None else (result, new_residual)


def fp8_small_m_matmul_ref(
    q: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, norm_after: torch.Tensor | None = None, eps: float = 1e-6,
    residual: torch.Tensor | None = None, quantize: bool = False,
) -> Any:
    """Plain-torch :func:`fp8_small_m_matmul`: dequantized operands multiplied in fp32, then
    ``rms_norm_ref``."""
    if x_scale is None:
        q, x_scale = per_token_quant_fp8_ref(q)
    y = (q.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(out_dtype)
    if norm_after is None:
        return y
    return rms_norm_ref(y, norm_after, eps, residual, quantize=quantize)
