"""Products of a few rows (decode batches of up to MAX_ROWS sequences) with a layer's
pointwise work folded into the one launch that streams the weight.

The weight is read once, split over (output column block, inner-dim split) programs; the last
program of a column block to finish sums the splits' partial products (an arrival counter),
so a product is one kernel with no separate reduce. Two foldings:

- ``norm_weight``: the input is ``rms_norm(x [+ residual]) * norm_weight``, made as each
  program loads it (a first pass over the rows gives every program their statistics); with a
  ``residual`` the rounded sum ``x + residual`` is written out once, as the new residual.
- ``silu_mul``: ``weight`` holds the gate rows then the up rows (a merged projection) and the
  output is ``silu(gate) * up``: each program computes a block of gate columns and the same
  block of up columns.
- ``silu_in``: the other side of SwiGLU: ``x`` is a merged gate/up product (the gate's K
  columns then the up's) and the product reads ``silu(gate) * up``, made as each program loads
  its inner-dim slice (the down projection after a cuBLAS gate/up).
- ``norm_after``: the output is ``rms_norm(product [+ residual]) * norm_after`` (the norm after
  an output or down projection): the last program of the launch to finish (a second arrival
  counter) reads the whole product back and normalises it in place, rows one at a time; with a
  ``residual`` the rounded sum is written out as the new residual
  (``sluiceway_kernels/_norm_after.py``).
- (float8 weights, ``sluiceway_kernels/fp8_small_m.py``) ``x_quant``: x is float, and each
  program quantizes its rows per token as it loads them (``per_token_quant_fp8``'s scales,
  which every program finds alike from a read of the whole rows): no quantization kernel before.

So a decoder layer at batch 1-8 is five kernels, either way: q/k/v with the input norm,
attention, the output projection, gate/up with the post-attention norm and SwiGLU, the down
projection (``norm_weight``, ``silu_mul``); or cuBLAS's q/k/v, attention, the output projection
with the post-attention norm after it, cuBLAS's gate/up, the down projection with SwiGLU before
it and the next layer's input norm after it (``silu_in``, ``norm_after``).
Rounding follows the unfused kernels step by step (``rms_norm``, the product rounded to the
dtype, ``silu_and_mul``); only the order of the sums differs from theirs.
"""

from __future__ import annotations

import torch

from sluiceway_kernels._common import (
    FLOAT_DTYPES, check_same_device, check_shape, check_tensor, interpreting, next_pow2, num_sms, split_counters, tl,
    pdl_options, release_dependents, triton, wait_for_previous,
)
from sluiceway_kernels._norm_after import _norm_after, _normed
from sluiceway_kernels._small_m_tiles import _accumulate, _finish, _scaled
from sluiceway_kernels.fp8_quant import quantized_tile, row_scales
from sluiceway_kernels.rms_norm import rms_norm_ref
from sluiceway_kernels.silu_mul import silu_and_mul_ref
from sluiceway_kernels.silu_mul_gemv import choose_split_k

MAX_ROWS = 16  # rows one launch takes (tl.dot's smallest tile)
# NOTE: the widest chunk of a row ``norm_after`` holds at once: up to it (llama3-8b's 4,096) a
# row is read once and normalised from registers; wider rows are read twice (three times when
# the output is quantized)
NORM_AFTER_BLOCK = 4096
# NOTE: the widest chunk of a row a pass over whole rows reads at once (BLOCK_X): the in-launch
# quantization's scales (X_QUANT), the norm's statistics of a one-row product (ONE_ROW); a
# 4,096-wide row (llama3-8b's hidden size) in one load rather than 32 dependent tile loads (128,
# BLOCK_K, is the old way: not yet measured against it, stage pdl's five_tiles)
ROW_BLOCK = 4096
# (BLOCK_N output columns, BLOCK_K inner dims per step, num_warps, num_stages)
CONFIG = (64, 128, 4, 4)
SILU_MUL_CONFIG = (32, 128, 4, 4)  # two weight tiles a step: the gate's and the up's


@triton.jit(do_not_specialize=["M", "k_blocks"])
def _small_m_linear_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, out_ptr, res_out_ptr, part_ptr, counter_ptr, xs_ptr, ws_ptr, bias_ptr,
    q_ptr, qscale_ptr, M, N, K, stride_xm, stride_rm, stride_wn, stride_om, stride_rom, k_blocks, up_row, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_IN: tl.constexpr, NORM_AFTER: tl.constexpr, BLOCK_H: tl.constexpr, ONE_CHUNK: tl.constexpr,
    QUANT_AFTER: tl.constexpr, ONE_ROW: tl.constexpr, PRELOAD: tl.constexpr, X_QUANT: tl.constexpr,
    BLOCK_X: tl.constexpr, PDL: tl.constexpr,
):
    # NOTE: NORM (before the product) and NORM_AFTER share norm_w_ptr, res_ptr and res_out_ptr
    # (their residuals are (M, K) and (M, N)); a launch takes one of them
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    # NOTE: a split's width in whole BLOCK_K tiles, so the compiler knows every tile starts at a
    # multiple of BLOCK_K: the weight then streams in 16-byte loads. Given as a width in
    # elements (not specialized: any split count) it could not, and every element was a
    # 2-byte load of its own (ld.global.b16 in the PTX)
    k_start = pid_k * k_blocks * BLOCK_K
    k_end = tl.minimum(k_start + k_blocks * BLOCK_K, K)
    # NOTE: a plain product (no norm, SiLU-mul or SwiGLU prologue) loads its first weight tile
    # before it waits for the kernel before it (no kernel writes weights): under programmatic
    # dependent launch (_common.PDL) that read overlaps the previous kernel (an H100 at batch 1:
    # 6.10-6.11 ms a token against 6.13-6.14)
    if PRELOAD:
        w_first = tl.load(w_rows + (k_start + ks)[None, :], mask=col_mask[:, None] & (k_start + ks < k_end)[None, :],
                          other=0.0)
    wait_for_previous(PDL, False)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    # X_QUANT: x (float) is quantized per token here, as per_token_quant_fp8 would before the
    # launch: every program finds the rows' scales over the whole inner dim (a read from L2)
    x_scale = row_scales(x_ptr, stride_xm, M, K, BLOCK_M, BLOCK_X) if X_QUANT else tl.zeros((BLOCK_M,), tl.float32)
    r_rows = res_ptr + rows[:, None].to(tl.int64) * stride_rm
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    rstd_one = 0.0
    if NORM:  # the rows' statistics over the whole inner dim, whatever this program's split
        writes_residual = (pid_n == 0) & (pid_k == 0)
        if ONE_ROW:  # the one real row's alone, in chunks of BLOCK_X (the whole of a 4,096-wide row at once)
            squares_one = 0.0
            for k0 in range(0, K, BLOCK_X):
                k = k0 + tl.arange(0, BLOCK_X)
                xf = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    summed = (xf + tl.load(res_ptr + k, mask=k < K, other=0.0).to(tl.float32)).to(dtype)
                    if writes_residual:
                        tl.store(res_out_ptr + k, summed, mask=k < K)
                    xf = summed.to(tl.float32)
                squares_one += tl.sum(xf * xf, 0)
            rstd_one = 1.0 / tl.sqrt(squares_one / K + eps)
        else:
            squares = tl.zeros((BLOCK_M,), tl.float32)
            ro_rows = res_out_ptr + rows[:, None].to(tl.int64) * stride_rom
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                mask = row_mask[:, None] & (k < K)[None, :]
                xf = tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:  # one add rounded to the dtype, as rms_norm stores the new residual
                    summed = (xf + tl.load(r_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)).to(dtype)
                    if writes_residual:
                        tl.store(ro_rows + k[None, :], summed, mask=mask)
                    xf = summed.to(tl.float32)
                squares += tl.sum(xf * xf, 1)
            rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_loop = k_start
    if PRELOAD:  # the first step with the tile loaded before the wait (a plain x: no prologue)
        k = k_start + ks
        a = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k < k_end)[None, :], other=0.0)
        if X_QUANT:
            a = quantized_tile(a, x_scale)
        acc = _accumulate(acc, a, w_first, DOT, UPCAST, PRECISION)
        k_loop = k_start + BLOCK_K
    for k0 in range(k_loop, k_end, BLOCK_K):
        k = k0 + ks
        k_mask = k < k_end
        mask = row_mask[:, None] & k_mask[None, :]
        if ONE_ROW:  # the prologue over the one real row; the dot tile's other rows are zeros
            if SILU_IN:
                gate = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + K + k, mask=k_mask, other=0.0).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
            else:  # NORM: rms_norm's steps, as below
                af = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    af = (af + tl.load(res_ptr + k, mask=k_mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
                act = _normed(af, rstd_one, norm_w_ptr, k, k_mask, dtype).to(dtype)
            a = tl.where(rows[:, None] == 0, act[None, :], tl.zeros((BLOCK_M, BLOCK_K), dtype))
        else:
            a = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
            if X_QUANT:
                a = quantized_tile(a, x_scale)
            if SILU_IN:  # silu_and_mul's steps: silu(gate) * up in fp32, rounded once
                gate = a.to(tl.float32)
                up = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
                a = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
            if NORM:  # rms_norm's steps: the rounded sum, normalised and rounded, times the weight, rounded
                af = a.to(tl.float32)
                if HAS_RESIDUAL:
                    af = (af + tl.load(r_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)).to(dtype)
                    af = af.to(tl.float32)
                norm_w = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                a = ((af * rstd[:, None]).to(dtype).to(tl.float32) * norm_w[None, :]).to(dtype)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)  # (BLOCK_N, BLOCK_K)
        acc = _accumulate(acc, a, w, DOT, UPCAST, PRECISION)
        if SILU_MUL:
            w_up = tl.load(w_rows + up_row * stride_wn + k[None, :], mask=w_mask, other=0.0)
            acc_up = _accumulate(acc_up, a, w_up, DOT, UPCAST, PRECISION)
    # NOTE: the weights are read: the next kernel may be scheduled beside the epilogue. Released
    # at the start, gate/up's programs that did not fit on the GPU at once waited behind the next
    # kernel's (the five-kernel layer on an H100: 6.95 ms a token released here, 7.36 there)
    release_dependents(PDL)
    out_mask = row_mask[:, None] & col_mask[None, :]
    dst = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        acc = _scaled(acc, xs_ptr, ws_ptr, bias_ptr, rows, cols, row_mask, col_mask, x_scale, SCALED, HAS_BIAS,
                      X_QUANT)
        _finish(dst, acc, acc_up, out_mask, SILU_MUL)
        if NORM_AFTER:
            _norm_after(out_ptr, res_ptr, res_out_ptr, norm_w_ptr, counter_ptr + tl.num_programs(0), q_ptr, qscale_ptr,
                        M, N, stride_om, stride_rm, stride_rom, eps, HAS_RESIDUAL, BLOCK_H, ONE_CHUNK, QUANT_AFTER)
    else:
        slab = BLOCK_M * N  # one split's (BLOCK_M, N) partial sums
        tile = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k * slab + tile, acc, mask=out_mask)
        if SILU_MUL:
            tl.store(part_ptr + (SPLIT_K + pid_k) * slab + tile, acc_up, mask=out_mask)
        tl.debug_barrier()  # every thread's partials before the counter's release
        counter = counter_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            total_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * slab + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                if SILU_MUL:
                    total_up += tl.load(part_ptr + (SPLIT_K + s) * slab + tile, mask=out_mask, other=0.0,
                                        cache_modifier=".cg")
            total = _scaled(total, xs_ptr, ws_ptr, bias_ptr, rows, cols, row_mask, col_mask, x_scale, SCALED,
                            HAS_BIAS, X_QUANT)
            _finish(dst, total, total_up, out_mask, SILU_MUL)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            if NORM_AFTER:
                _norm_after(out_ptr, res_ptr, res_out_ptr, norm_w_ptr, counter_ptr + tl.num_programs(0), q_ptr,
                            qscale_ptr, M, N, stride_om, stride_rm, stride_rom, eps, HAS_RESIDUAL, BLOCK_H, ONE_CHUNK,
                            QUANT_AFTER)


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    split_k: int | None = None,
    dot: bool = True,
    silu_in: bool = False,
    norm_after: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T`` for up to MAX_ROWS rows in one launch, with the folding the module
    docstring describes.

    Args:
        x: (M, K), M <= MAX_ROWS, contiguous in K; any float dtype.
        weight: (N, K) in x's dtype, contiguous (an nn.Linear weight); with ``silu_mul`` (2I, K),
            the gate's I rows then the up's.
        norm_weight: (K,) float: normalise x first (``rms_norm(x, norm_weight, eps, residual)``).
        residual: (M, K) of x's dtype with ``norm_weight``: normalise ``x + residual``; (M, N) with
            ``norm_after``: normalise ``product + residual``.
        silu_mul: the output is ``silu_and_mul`` of the product: (M, I).
        out: optional output of x's dtype, (M, N) or (M, I).
        config, split_k: override the tiles and the inner-dim split (tests, probes).
        dot: products on the tensor cores over 16-row tiles (rows past M are zeros), or
            (False) as multiply-adds over the next power of two of M rows (probes).
        silu_in: x is (M, 2K), a gate/up product (the gate's K columns, then the up's): the
            product is ``silu_and_mul(x) @ weight.T``.
        norm_after: (N,) float: the output is ``rms_norm(product, norm_after, eps, residual)``;
            not with ``norm_weight``.

    Returns ``out``, or ``(out, new_residual)`` with a residual. fp32 accumulation; no host
    synchronisation, so it can be captured in a CUDA graph once it has run outside one.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, (x.dtype,))
    m, inner = x.shape
    rows, width = weight.shape
    if silu_in:
        if silu_mul or norm_weight is not None:
            raise ValueError("silu_in takes neither silu_mul nor norm_weight: x is already a gate/up product")
        if inner != 2 * width:
            raise ValueError(f"with silu_in x holds the gate then the up columns: {2 * width} for weight's "
                             f"{width}, got {inner}")
        inner = width
    if width != inner:
        raise ValueError(f"weight has {width} columns; expected x's {inner}")
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows; small_m_linear takes at most {MAX_ROWS}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    if silu_mul and rows % 2:
        raise ValueError(f"with silu_mul weight holds the gate then the up rows: an even count, got {rows}")
    n = rows // 2 if silu_mul else rows
    tensors = dict(x=x, weight=weight)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, 1, FLOAT_DTYPES)
        check_shape("norm_weight", norm_weight, (inner,))
        tensors["norm_weight"] = norm_weight
    if norm_after is not None:
        if norm_weight is not None:
            raise ValueError("norm_weight and norm_after: one norm a launch, before the product or after it")
        check_tensor("norm_after", norm_after, 1, FLOAT_DTYPES)
        check_shape("norm_after", norm_after, (n,))
        tensors["norm_after"] = norm_after
    if residual is not None:
        if norm_weight is None and norm_after is None:
            raise ValueError("residual goes with norm_weight or norm_after: it is added before the norm")
        check_tensor("residual", residual, 2, (x.dtype,))
        check_shape("residual", residual, (m, inner) if norm_weight is not None else (m, n))
        tensors["residual"] = residual
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, 2, (x.dtype,))
        check_shape("out", out, (m, n))
        tensors["out"] = out
    check_same_device(**tensors)
    new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format) if residual is not None else None
    if m == 0:
        return out if residual is None else (out, new_residual)
    _launch(x, weight, out, config or (SILU_MUL_CONFIG if silu_mul else CONFIG), split_k, dot,
            norm_weight=norm_weight, eps=eps, residual=residual, new_residual=new_residual, silu_mul=silu_mul,
            silu_in=silu_in, norm_after=norm_after)
    return out if residual is None else (out, new_residual)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int, int], split_k: int | None,
    dot: bool, norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None, silu_mul: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None, name: str = "small_m_linear",
    silu_in: bool = False, norm_after: torch.Tensor | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None, x_quant: bool = False,
) -> None:
    """One launch of the kernel over checked arguments (``scales``: a float8 product's row
    scales (M, 1), column scales (N,) and bias, applied before the output is rounded; ``name``:
    whose split counters it uses; ``quantized``: with ``norm_after``, float8 (M, N) and fp32
    (M, 1) contiguous buffers the normalised rows go to, quantized per token; ``x_quant``: x is
    float and the launch quantizes it per token for a float8 weight, its row scales unused)."""
    m, n = out.shape
    inner = weight.shape[1]
    block_n, block_k, warps, stages = config
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = choose_split_k(n_blocks, inner, block_k, num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(inner, split_k), block_k) * block_k
    split_k = triton.cdiv(inner, k_per_split)
    block_m = MAX_ROWS if dot else next_pow2(m)
    part = counters = out
    if split_k > 1:
        part = torch.empty(((2 if silu_mul else 1) * split_k, block_m, n), dtype=torch.float32, device=x.device)
    if split_k > 1 or norm_after is not None:  # a counter per column block, then the launch's
        counters = split_counters(x.device, n_blocks + 1, name)
    norm = norm_weight is not None
    if norm_after is not None:
        norm_weight = norm_after
    block_h = min(next_pow2(n), NORM_AFTER_BLOCK)
    res = residual if residual is not None else x
    res_out = new_residual if new_residual is not None else x
    x_scale, w_scale, bias = scales or (out, out, None)
    q, q_scale = quantized or (out, out)
    _small_m_linear_kernel[(n_blocks, split_k)](
        x, res, norm_weight if norm_weight is not None else x, weight, out, res_out, part, counters,
        x_scale, w_scale, bias if bias is not None else w_scale, q, q_scale,
        m, n, inner, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        k_per_split // block_k, n, float(eps),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        NORM=norm, HAS_RESIDUAL=residual is not None, SILU_MUL=bool(silu_mul), DOT=bool(dot),
        UPCAST=interpreting() and (x_quant or x.dtype in (torch.bfloat16, torch.float8_e4m3fn)),
        # fp32 models: exact fp32 products (float8 operands take no precision)
        PRECISION="ieee" if x.dtype == torch.float32 and not x_quant else "tf32",
        SCALED=scales is not None, HAS_BIAS=bias is not None,
        SILU_IN=bool(silu_in), NORM_AFTER=norm_after is not None, BLOCK_H=block_h, ONE_CHUNK=n <= block_h,
        QUANT_AFTER=quantized is not None,
        # NOTE: SiLU-mul or the norm in the prologue of a one-row product is computed for that
        # row alone, not for the 16-row dot tile (batch-1 decode, where every program repeats it)
        ONE_ROW=(bool(silu_in) or norm) and dot and m == 1,
        PRELOAD=not (norm or silu_in or silu_mul), X_QUANT=x_quant, BLOCK_X=min(next_pow2(inner), ROW_BLOCK),
        num_warps=warps, num_stages=stages, **pdl_options(x.device),
    )


def small_m_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    split_k: int | None = None,
    dot: bool = True,
    silu_in: bool = False,
    norm_after: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`small_m_linear`: ``rms_norm_ref``, an fp32 product rounded to the
    dtype, ``silu_and_mul_ref``, in the order the folding says; any number of rows."""
    new_residual = None
    if silu_in:
        x = silu_and_mul_ref(x)
    if norm_weight is not None:
        normed = rms_norm_ref(x, norm_weight, eps, residual)
        x, new_residual = normed if residual is not None else (normed, None)
    result = (x.float() @ weight.float().t()).to(x.dtype)
    if silu_mul:
        result = silu_and_mul_ref(result)
    if norm_after is not None:
        normed = rms_norm_ref(result, norm_after, eps, residual)
        result, new_residual = normed if residual is not None else (normed, None)
    if out is not None:
        result = out.copy_(result)
    return result if new_residual is None else (result, new_residual)
