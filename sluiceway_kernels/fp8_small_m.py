"""W8A8 product for a few tokens (decode at small batch): float8 activations (T, K) with
per-token scales times float8 weights (N, K) with per-channel scales, both scales and the bias
applied before the one rounding to the output's dtype, in one launch.

At 1-64 tokens cuBLASLt's rowwise-scaled float8 product runs no faster than bf16, and its
unit-scale one needs a second kernel for the scales (docs/BENCHMARKS.md). This is
``small_m_linear``'s kernel over float8 operands: the weight is read once, split over (output
column block, inner-dim split) programs, and the last program of a column block to finish sums
the splits and applies the scales (an arrival counter), so no reduce or epilogue kernel follows.
"""

from __future__ import annotations

import torch

from sluiceway_kernels._common import FLOAT_DTYPES, check_same_device, check_tensor
from sluiceway_kernels.fp8_quant import FP8_DTYPE
from sluiceway_kernels.small_m_linear import MAX_ROWS, _launch

MAX_TOKENS = MAX_ROWS  # one BLOCK_M tile
# (BLOCK_N output columns, BLOCK_K inner dims per step, num_warps, num_stages): 256 one-byte
# weights a row per step, the bytes bf16's 128 are
CONFIG = (64, 256, 4, 4)


def fp8_small_m_matmul(
    q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, config: tuple[int, int, int, int] | None = None,
    split_k: int | None = None, dot: bool = True,
) -> torch.Tensor:
    """``(q * x_scale) @ (weight * weight_scale[:, None])^T + bias``, accumulated in fp32, for
    up to MAX_TOKENS tokens.

    Args:
        q: (T, K) float8_e4m3fn, T <= MAX_TOKENS, last dim contiguous; x_scale: (T, 1) float32,
            contiguous.
        weight: (N, K) float8_e4m3fn, contiguous; weight_scale: (N,) float32, contiguous.
        bias: optional (N,) float. out_dtype: float32, float16 or bfloat16.
        config, split_k, dot: override the tiles, the inner-dim split and the tensor-core
            product (tests, probes), as for ``small_m_linear``.

    Returns: (T, N) of ``out_dtype``. No host synchronisation: it can be captured in a CUDA
    graph once it has run outside one.
    """
    check_tensor("q", q, 2, (FP8_DTYPE,))
    check_tensor("weight", weight, 2, (FP8_DTYPE,))
    num_tokens, k = q.shape
    n = weight.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"q has {num_tokens} tokens; this kernel takes at most {MAX_TOKENS}")
    if weight.shape[1] != k:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (N, {k})")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    check_tensor("x_scale", x_scale, 2, (torch.float32,))
    check_tensor("weight_scale", weight_scale, 1, (torch.float32,))
    if tuple(x_scale.shape) != (num_tokens, 1) or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"x_scale {tuple(x_scale.shape)} / weight_scale {tuple(weight_scale.shape)} do not fit: "
                         f"expected ({num_tokens}, 1) and ({n},)")
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
    check_same_device(**tensors)
    out = torch.empty((num_tokens, n), dtype=out_dtype, device=q.device)
    if num_tokens and n:
        _launch(q, weight, out, config or CONFIG, split_k, dot, scales=(x_scale, weight_scale, bias),
                name="fp8_small_m")
    return out
