"""Triton functions of ``small_m_linear``'s kernel over one output tile: the tile's product step,
a float8 product's scales and bias, and its rounding and store."""

from __future__ import annotations

from sluiceway_kernels._common import tl, triton


@triton.jit
def _finish(dst, acc, acc_up, mask, SILU_MUL: tl.constexpr):
    """Round the fp32 sums to the output's dtype (as a GEMM writes them) and store them, or
    silu(gate) * up of the two rounded sums, rounded once more (as silu_and_mul does)."""
    dtype = dst.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        tl.store(dst, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=mask)
    else:
        tl.store(dst, acc.to(dtype), mask=mask)


@triton.jit
def _scaled(acc, xs_ptr, ws_ptr, bias_ptr, rows, cols, row_mask, col_mask, x_scale, SCALED: tl.constexpr,
            HAS_BIAS: tl.constexpr, X_QUANT: tl.constexpr):
    """A float8 product's scales and bias in fp32, in ``scale_epilogue``'s order: acc * the row's
    scale * the column's scale + bias. The rows' scales: ``x_scale`` (X_QUANT: found in the
    launch), else loaded."""
    if SCALED:
        if X_QUANT:
            row_scale = x_scale
        else:
            row_scale = tl.load(xs_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * row_scale[:, None] * tl.load(ws_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _accumulate(acc, a, w, DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) += a (BLOCK_M, BLOCK_K) @ w (BLOCK_N, BLOCK_K).T: on the tensor
    cores (BLOCK_M >= 16, rows past M are zeros), or as fp32 multiply-adds (any BLOCK_M: one
    or two rows waste nothing)."""
    if DOT:
        if UPCAST:  # the interpreter multiplies bf16 bits in tl.dot: widen first
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc + tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
