"""The MLP's down projection for a few rows, with SwiGLU (silu(gate) * up) in its prologue.

``silu_mul_linear(gate_up, weight)`` = ``silu_and_mul(gate_up) @ weight.T`` without writing
the activation: each program computes it for its slice of the inner dim as it loads it. The
weight is read once, split over (output columns, inner dim) programs; the last program of a
column block to finish sums the column block's partial products (an arrival counter), so the
whole product is one launch.
"""

from __future__ import annotations

import math

import torch

from sluiceway_kernels._common import (
    FLOAT_DTYPES, check_same_device, check_tensor, interpreting, num_sms, split_counters, tl, triton,
)
from sluiceway_kernels.silu_mul import silu_and_mul_ref

MAX_ROWS = 16  # rows one launch takes: decode batches of up to 16 sequences
# (BLOCK_N output columns, BLOCK_K inner dims per step, num_warps, num_stages)
GEMV_CONFIG = (64, 128, 4, 4)


@triton.jit(do_not_specialize=["M", "k_blocks"])
def _silu_mul_gemv_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, counter_ptr,
    M, N, inner, stride_xm, stride_wn, stride_om, k_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    # NOTE: in whole BLOCK_K tiles, so the tiles' alignment is known and the weight streams in
    # 16-byte loads (small_m_linear.py says more)
    k_start = pid_k * k_blocks * BLOCK_K
    k_end = tl.minimum(k_start + k_blocks * BLOCK_K, inner)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        k_mask = k < k_end
        x_mask = row_mask[:, None] & k_mask[None, :]
        gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + inner + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)  # as silu_and_mul rounds it
        w = tl.load(w_rows + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
        if UPCAST:  # the interpreter multiplies bf16 bits in tl.dot: widen first
            act = act.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(act, tl.trans(w), acc, input_precision=PRECISION)
    out_mask = row_mask[:, None] & col_mask[None, :]
    dst = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rows[:, None] * N + cols[None, :]  # (BLOCK_M, BLOCK_N) in one split's (BLOCK_M, N) slab
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial before the counter's release
        counter = counter_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def choose_split_k(n_blocks: int, inner: int, block_k: int, sms: int) -> int:
    """Inner-dim splits that give the SMs about two programs each, with >= 4 steps per split."""
    want = max(1, math.ceil(2 * sms / n_blocks))
    return max(1, min(want, inner // (4 * block_k), 8))


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None, split_k: int | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` projected by ``weight``, for up to MAX_ROWS rows, in one launch.

    Args:
        gate_up: (M, 2I), the gate then the up projection, M <= MAX_ROWS, contiguous rows.
        weight: (N, I) in gate_up's dtype, contiguous (an nn.Linear weight).
        out: optional (M, N) of gate_up's dtype.
        config, split_k: override the tile configuration and the inner-dim split (tests, probes).

    Returns ``out``. The activation is rounded to gate_up's dtype before the product, as
    ``silu_and_mul`` then a GEMM would; the product accumulates in fp32.
    """
    check_tensor("gate_up", gate_up, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, (gate_up.dtype,))
    m, width = gate_up.shape
    n, inner = weight.shape
    if width != 2 * inner:
        raise ValueError(f"gate_up has {width} columns; expected 2 x weight's {inner}")
    if m > MAX_ROWS:
        raise ValueError(f"gate_up has {m} rows; silu_mul_linear takes at most {MAX_ROWS}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    if out is None:
        out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    else:
        check_tensor("out", out, 2, (gate_up.dtype,))
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {(m, n)}")
    check_same_device(gate_up=gate_up, weight=weight, out=out)
    if m == 0:
        return out
    block_n, block_k, warps, stages = config or GEMV_CONFIG
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = choose_split_k(n_blocks, inner, block_k, num_sms(gate_up.device))
    k_per_split = triton.cdiv(triton.cdiv(inner, split_k), block_k) * block_k
    split_k = triton.cdiv(inner, k_per_split)
    part = counters = out
    if split_k > 1:
        part = torch.empty((split_k, MAX_ROWS, n), dtype=torch.float32, device=gate_up.device)
        counters = split_counters(gate_up.device, n_blocks, "silu_mul_gemv")
    _silu_mul_gemv_kernel[(n_blocks, split_k)](
        gate_up, weight, out, part, counters,
        m, n, inner, gate_up.stride(0), weight.stride(0), out.stride(0), k_per_split // block_k,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        UPCAST=interpreting() and gate_up.dtype == torch.bfloat16,
        PRECISION="ieee" if gate_up.dtype == torch.float32 else "tf32",  # fp32 models: exact fp32 products
        num_warps=warps, num_stages=stages,
    )
    return out


def silu_mul_linear_ref(
    gate_up: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None, split_k: int | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`silu_mul_linear`: ``silu_and_mul`` rounded to the dtype, then an fp32 product."""
    act = silu_and_mul_ref(gate_up)
    result = (act.float() @ weight.float().t()).to(gate_up.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
