"""W8A8 FP8 linear layers (``quantization="fp8"``): float8 e4m3 weights with one fp32 scale
per output channel, activations quantized per token as they enter each layer.

``fp8_linear`` is the one matmul every quantized layer calls:

- CUDA GPUs of compute capability 8.9+ (Ada, Hopper): the tokens are quantized by a Triton
  kernel, then ``torch._scaled_mm`` multiplies float8 by float8 in fp32 and applies the
  token and channel scales in its epilogue (rowwise scales). At a few tokens a step
  (decode at small batch) rowwise scales run no faster than bf16, so there the product is
  taken with unit (tensorwise) scales into fp32 and a small kernel applies both scales, or
  (up to ``TRITON_ROWS`` tokens) by our split-K kernel with the scales folded in.
- Elsewhere (CPU): an exact emulation, quantize -> dequantize -> fp32 matmul, which is the
  reference the GPU path is compared against and what CI runs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from collections.abc import Callable

from engine.config import QUANTIZATIONS
from sluiceway_kernels.fp8_quant import (FP8_DTYPE, UnscaledProduct, per_token_quant_fp8, per_token_quant_fp8_ref,
                                         quantize_rows_ref, scale_epilogue, scale_of_amax)
from sluiceway_kernels._common import interpreting
from sluiceway_kernels.fp8_small_m import fp8_small_m_matmul, fp8_small_m_matmul_ref

# NOTE: up to this many tokens a step the unit-scale product plus the scale epilogue beats
# rowwise scales on an H200 (llama3-8b layers in a CUDA graph: 76-84 us against 107-117 us
# per layer at M=1..64; rowwise wins at 512); docs/BENCHMARKS.md has the table.
SMALL_M = 64
# NOTE: up to this many tokens the product is our split-K kernel with both scales applied before
# its one rounding (sluiceway_kernels/fp8_small_m.py): no epilogue kernel, nothing left unscaled,
# and exact to fp32 summation order where cuBLASLt's float8 product was off by up to 1.5e-3. Off
# (0): on an H100 batch-1 decode took 4.47 against 4.33 ms a token with it (311 launches against
# 407), and one layer's four products 91-96 against 94 us (2026-12-06, session 28).
TRITON_ROWS = 0


class Fp8Input(NamedTuple):
    """Activations already quantized per token by the kernel that produced them (RMSNorm,
    SiLU·mul): what an FP8 linear layer takes instead of a float tensor."""

    q: torch.Tensor  # (T, K) float8_e4m3fn
    scale: torch.Tensor  # (T, 1) float32
    dtype: torch.dtype  # the activations' dtype: the layer's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def check_quantization(quantization: str | None) -> str | None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    return quantization


def check_fp8_device(device: torch.device) -> None:
    """FP8 matmuls need a GPU of compute capability 8.9+; the CPU emulates them."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"quantization='fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
            f"{major}.{minor}: leave quantization unset"
        )


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight (N, K) -> (float8 (N, K), fp32 scales (N,)): one scale per output channel."""
    if w.is_cuda:
        q, scale = per_token_quant_fp8(w.contiguous())
        return q, scale.view(-1)
    return quantize_rows_ref(w)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 (N, K) with per-row scales (N,) -> fp32 (N, K)."""
    return q.float() * scale.float().view(-1, 1)


def fp8_matmul_emulated(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The reference W8A8 product: dequantize both operands, multiply in fp32.

    q (M, K) float8 with x_scale (M, 1); weight (N, K) float8 with weight_scale (N,) -> (M, N).
    """
    y = (q.float() * x_scale.float()) @ dequantize_rows(weight, weight_scale).t()  # (M, N) fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_linear(x: torch.Tensor | Fp8Input, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
               defer_scales: bool = False) -> torch.Tensor | UnscaledProduct:
    """``y = x W^T + b`` with W float8 (N, K) and per-channel scales (N,); x (..., K) float,
    or an ``Fp8Input`` already quantized per token.

    ``amax_reduce``: for an input whose rows are split across ranks (row-parallel layers),
    reduces each token's (M, 1) largest magnitude over the ranks in place, so every shard of
    a token shares the scale of its whole row. Returns x's dtype, shape (..., N); with
    ``defer_scales``, where the product is taken with unit scales (2-D x of up to SMALL_M rows
    on a GPU, half-precision activations), the ``UnscaledProduct`` whose scales the kernel
    reading it next applies.
    """
    out_features, in_features = weight.shape
    if isinstance(x, Fp8Input):
        if amax_reduce is not None:
            raise ValueError("an input quantized by its producer cannot take scales reduced over ranks")
        y = _product(x.q.reshape(-1, in_features), x.scale, weight, weight_scale, bias, x.dtype,
                     defer_scales and x.q.dim() == 2)
        return y if isinstance(y, UnscaledProduct) else y.view(*x.q.shape[:-1], out_features)
    rows = x.reshape(-1, in_features)  # (M, K)
    x_scale = None
    if amax_reduce is not None:
        x_scale = scale_of_amax(amax_reduce(rows.abs().amax(dim=-1, keepdim=True).float()))  # (M, 1)
    quantize = per_token_quant_fp8 if _runs_scaled_mm(rows, weight) else per_token_quant_fp8_ref
    q, x_scale = quantize(rows, x_scale)  # (M, K) float8, (M, 1) fp32
    y = _product(q, x_scale, weight, weight_scale, bias, x.dtype, defer_scales and x.dim() == 2)
    return y if isinstance(y, UnscaledProduct) else y.view(*x.shape[:-1], out_features)


def _runs_scaled_mm(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    # NOTE: cuBLASLt's float8 products need K and N divisible by 16; other shapes (toy
    # models only) take the emulation on the GPU too.
    return rows.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _product(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, defer: bool = False) -> torch.Tensor | UnscaledProduct:
    """The W8A8 product of quantized rows q (M, K) with scales (M, 1): (M, N) of out_dtype, or
    (``defer``) the ``UnscaledProduct`` where it is taken with unit scales."""
    if not _runs_scaled_mm(q, weight):
        y = fp8_matmul_emulated(q, x_scale, weight, weight_scale, bias, out_dtype)
    elif q.shape[0] <= TRITON_ROWS:
        y = fp8_small_m_matmul(q, x_scale.contiguous(), weight, weight_scale, bias, out_dtype)
    else:
        if q.shape[0] <= SMALL_M or out_dtype != torch.bfloat16:
            # rowwise scales need a bf16 output; small M runs faster with unit scales anyway
            one = _unit_scale(q.device)
            y32 = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)  # (M, N)
            # NOTE: the next kernel applies the scales as it loads y32: one launch fewer. Half-precision
            # outputs only: their rounding after the scales keeps the reader bit for bit the epilogue;
            # in fp32 the reader's residual add was contracted with the scaling into one fused
            # multiply-add, one rounding fewer than the epilogue (an H100, 2026-12-06)
            if defer and out_dtype != torch.float32:
                return UnscaledProduct(y32, x_scale, weight_scale, bias, out_dtype)
            y = scale_epilogue(y32, x_scale, weight_scale, bias, out_dtype)
        else:
            y = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                 out_dtype=torch.bfloat16)  # (M, N)
            if bias is not None:
                y = y + bias
    return y


def fp8_small_m_linear(x: torch.Tensor | Fp8Input, weight: torch.Tensor, weight_scale: torch.Tensor,
                       norm_after: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, quantize: bool = False) -> Any:
    """A few rows' W8A8 product by our split-K kernel, with the RMSNorm that reads it in the
    same launch (``norm_after``, ``residual``; ``quantize``: its output quantized per token, an
    ``Fp8Input`` for the next FP8 layer): ``fp8_small_m_matmul``. x, unless it comes as an
    ``Fp8Input``, is quantized per token in the same launch. Returns what ``fp8_small_m_matmul``
    returns, the quantized pair as an ``Fp8Input``; its torch reference where Triton cannot run."""
    if isinstance(x, Fp8Input):
        q, x_scale, dtype = x
        x_scale = x_scale.contiguous()
    else:  # quantized per token inside the launch (the reference: before it)
        q, x_scale, dtype = x, None, x.dtype
    op = fp8_small_m_matmul if q.is_cuda or interpreting() else fp8_small_m_matmul_ref
    result = op(q, x_scale, weight, weight_scale, None, dtype, norm_after=norm_after, eps=eps,
                residual=residual, quantize=quantize)
    out, new_residual = result if residual is not None else (result, None)
    if quantize:
        out = Fp8Input(*out, dtype)
    return out if residual is None else (out, new_residual)


__all__ = ["Fp8Input", "UnscaledProduct", "QUANTIZATIONS", "FP8_DTYPE", "SMALL_M", "check_quantization", "check_fp8_device", "quantize_rows",
           "dequantize_rows", "fp8_matmul_emulated", "fp8_linear", "fp8_small_m_linear"]
