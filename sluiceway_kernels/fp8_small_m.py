"""W8A8 product for a few tokens (decode at small batch): float8 activations (T, K) with
per-token scales times float8 weights (N, K) with per-channel scales, both scales applied
in the epilogue of one kernel.

At 1-64 tokens cuBLASLt's rowwise-scaled float8 product runs no faster than bf16 and its
unit-scale one needs a second kernel for the scales (docs/BENCHMARKS.md); this kernel reads
the weights once, in tiles of BLOCK_N output channels by BLOCK_K, with the scales fused.
"""

from __future__ import annotations

import torch

from sluiceway_kernels._common import FLOAT_DTYPES, check_same_device, check_tensor, interpreting, num_sms, tl, triton
from sluiceway_kernels.fp8_quant import FP8_DTYPE

MAX_TOKENS = 16  # one BLOCK_M tile


@triton.jit
def _fp8_small_m_kernel(
    q_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    num_tokens, n, k, stride_q, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        k_ok = start + ks < k
        a = tl.load(q_ptr + rows[:, None] * stride_q + start + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K) float8
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + start + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_N) float8
        if UPCAST:  # every e4m3 value is exact in fp16, so the products are too
            acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
        else:
            acc = tl.dot(a, b, acc)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_small_m_matmul(
    q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, block_n: int | None = None, block_k: int = 256,
    upcast: bool | None = None,
) -> torch.Tensor:
    """``(q * x_scale) @ (weight * weight_scale[:, None])^T + bias`` in fp32, for up to 16 tokens.

    Args:
        q: (T, K) float8_e4m3fn, T <= 16, last dim contiguous; x_scale: (T, 1) float32.
        weight: (N, K) float8_e4m3fn, contiguous rows; weight_scale: (N,) float32.
        bias: optional (N,) float. out_dtype: float32, float16 or bfloat16.
        block_n: output channels per program (default: enough programs for two per SM).
        upcast: take the dot in fp16 (default: under the interpreter only).

    Returns: (T, N) of ``out_dtype``.
    """
    check_tensor("q", q, 2, (FP8_DTYPE,))
    check_tensor("weight", weight, 2, (FP8_DTYPE,))
    num_tokens, k = q.shape
    n = weight.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"q has {num_tokens} tokens; this kernel takes at most {MAX_TOKENS}")
    if weight.shape[1] != k:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected (N, {k})")
    check_tensor("x_scale", x_scale, 2, (torch.float32,))
    check_tensor("weight_scale", weight_scale, 1, (torch.float32,))
    if tuple(x_scale.shape) != (num_tokens, 1) or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"x_scale {tuple(x_scale.shape)} / weight_scale {tuple(weight_scale.shape)} do not fit: "
                         f"expected ({num_tokens}, 1) and ({n},)")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    tensors = dict(q=q, x_scale=x_scale, weight=weight, weight_scale=weight_scale)
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
        tensors["bias"] = bias
    device = check_same_device(**tensors)
    out = torch.empty((num_tokens, n), dtype=out_dtype, device=q.device)
    if num_tokens and n:
        if block_n is None:
            block_n = 64
            while block_n > 16 and -(-n // block_n) < 2 * num_sms(device):
                block_n //= 2
        _fp8_small_m_kernel[(-(-n // block_n),)](
            q, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out,
            num_tokens, n, k, q.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, UPCAST=interpreting() if upcast is None else upcast,
            BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
        )
    return out
