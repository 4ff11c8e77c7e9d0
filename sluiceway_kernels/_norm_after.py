"""The RMSNorm that ``small_m_linear`` can run after its product (``norm_after``): Triton
functions its kernel calls once an output block is stored, so that the launch's last column
block normalises the whole product in ``rms_norm``'s rounding steps, and with ``QUANT``
quantizes it per token to float8 as ``rms_norm(quantize=True)`` does."""

from __future__ import annotations

from sluiceway_kernels._common import tl, triton
from sluiceway_kernels.fp8_quant import AMAX_FLOOR, QMAX
from sluiceway_kernels.store_kvcache import _round_to_e4m3


@triton.jit
def _summed(o_row, r_row, ro_row, h, mask, dtype, HAS_RESIDUAL: tl.constexpr):
    """A chunk of a product's row plus the residual's, rounded to the dtype and written out as
    the new residual (as rms_norm stores it), in fp32."""
    summed = tl.load(o_row + h, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_RESIDUAL:
        summed = (summed.to(tl.float32) + tl.load(r_row + h, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(ro_row + h, summed, mask=mask)
    return summed.to(tl.float32)


@triton.jit
def _normed(summed, rstd, norm_w_ptr, h, mask, dtype):
    """rms_norm's last steps over a chunk: normalised and rounded, times the weight, rounded (fp32)."""
    w = tl.load(norm_w_ptr + h, mask=mask, other=0.0).to(tl.float32)
    return ((summed * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _store(o_row, q_row, h, mask, normed, qscale, QUANT: tl.constexpr):
    """A normalised chunk stored in place, or (QUANT) divided by the row's float8 scale and
    stored as float8."""
    if QUANT:
        q = _round_to_e4m3(tl.math.div_rn(normed, qscale), QMAX)
        tl.store(q_row + h, q.to(q_row.dtype.element_ty), mask=mask)
    else:
        tl.store(o_row + h, normed.to(o_row.dtype.element_ty), mask=mask)


@triton.jit
def _row_scale(amax, qscale_ptr, m):
    """The float8 scale of a row whose largest magnitude is ``amax``, stored for the reader."""
    qscale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), QMAX)
    tl.store(qscale_ptr + m, qscale)
    return qscale


@triton.jit
def _norm_after(out_ptr, res_ptr, res_out_ptr, norm_w_ptr, done_ptr, q_ptr, qscale_ptr, M, N, stride_om,
                stride_rm, stride_rom, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
                ONE_CHUNK: tl.constexpr, QUANT: tl.constexpr):
    """Called by each program once its output block is stored: the last of the launch's column
    blocks to get here normalises the whole (M, N) product in place (the sum with the residual
    rounded and written out, normalised and rounded, times the weight, rounded), or (QUANT)
    quantizes the normalised rows per token into ``q_ptr`` with their scales in ``qscale_ptr``,
    and returns the arrival counter to zero."""
    tl.debug_barrier()  # every thread's output before the counter's release
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        dtype = out_ptr.dtype.element_ty
        hs = tl.arange(0, BLOCK_H)
        for m in range(0, M):
            o_row = out_ptr + m * stride_om
            r_row = res_ptr + m * stride_rm
            ro_row = res_out_ptr + m * stride_rom
            q_row = q_ptr + m * N
            if ONE_CHUNK:  # the row stays in registers between its sum and its normalised store
                mask = hs < N
                summed = _summed(o_row, r_row, ro_row, hs, mask, dtype, HAS_RESIDUAL)
                normed = _normed(summed, 1.0 / tl.sqrt(tl.sum(summed * summed, 0) / N + eps), norm_w_ptr, hs, mask,
                                 dtype)
                qscale = 1.0
                if QUANT:
                    qscale = _row_scale(tl.max(tl.abs(normed), 0), qscale_ptr, m)
                _store(o_row, q_row, hs, mask, normed, qscale, QUANT)
            else:  # two passes (three to quantize); each reads back what the one before wrote (the same threads)
                squares = tl.zeros((BLOCK_H,), tl.float32)
                for h0 in range(0, N, BLOCK_H):
                    h = h0 + hs
                    summed = _summed(o_row, r_row, ro_row, h, h < N, dtype, HAS_RESIDUAL)
                    squares += summed * summed
                rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / N + eps)
                amax = tl.zeros((BLOCK_H,), tl.float32)
                for h0 in range(0, N, BLOCK_H):
                    h = h0 + hs
                    mask = h < N
                    if HAS_RESIDUAL:
                        summed = tl.load(ro_row + h, mask=mask, other=0.0).to(tl.float32)
                    else:
                        summed = tl.load(o_row + h, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                    normed = _normed(summed, rstd, norm_w_ptr, h, mask, dtype)
                    _store(o_row, q_row, h, mask, normed, 1.0, False)
                    amax = tl.maximum(amax, tl.abs(normed))
                if QUANT:
                    qscale = _row_scale(tl.max(amax, 0), qscale_ptr, m)
                    for h0 in range(0, N, BLOCK_H):
                        h = h0 + hs
                        mask = h < N
                        normed = tl.load(o_row + h, mask=mask, other=0.0).to(tl.float32)
                        _store(o_row, q_row, h, mask, normed, qscale, True)
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
