"""Greedy choice and log-normaliser of each logits row in one pass.

The sampler needs, for every sampled row, the first argmax (the greedy token) and
``logsumexp`` of the raw logits (the chosen token's logprob is its logit minus it). Done with
torch these are separate passes over the (rows x vocabulary) logits (argmax, max, exp, sum,
log); the kernel reads each logit once, keeping per lane a running maximum, the first column
reaching it and the sum of exponentials rescaled to that maximum (the online softmax).

Long rows are split across programs when the batch is small; a second kernel merges the
splits' partial (max, sum, column) triples (one split at large batches).
"""

from __future__ import annotations

import math

import torch

from sluiceway_kernels._common import FLOAT_DTYPES, check_tensor, num_sms, pdl_options, tl, triton, wait_for_previous

BLOCK_V = 1024
MIN_SPLIT = 8192  # columns: a split smaller than this costs more than it saves


@triton.jit(do_not_specialize=["split_tiles"])
def _argmax_lse_split_kernel(
    logits_ptr, part_max_ptr, part_sum_ptr, part_col_ptr,
    stride_l, vocab, split_tiles,
    BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_logits = logits_ptr + row.to(tl.int64) * stride_l
    # NOTE: in whole BLOCK_V tiles, so each tile's alignment is known: 16-byte loads, where a
    # split length in columns left every logit a load of its own
    start = split * split_tiles * BLOCK_V
    end = tl.minimum(start + split_tiles * BLOCK_V, vocab)
    lanes = tl.arange(0, BLOCK_V)
    # Lane-wise: running max, the first column reaching it (a later tile wins a lane only when
    # strictly greater), and sum(exp(x - max)) of the lane's columns so far.
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    best_col = tl.full((BLOCK_V,), 2147483647, tl.int32)
    total = tl.zeros((BLOCK_V,), tl.float32)
    for tile in range(start, end, BLOCK_V):
        cols = tile + lanes
        x = tl.load(row_logits + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        better = x > best
        new_best = tl.where(better, x, best)
        finite = new_best > float("-inf")  # nothing to add while the lane has seen only -inf
        shift = tl.where(finite, new_best, 0.0)  # keeps -inf - -inf (NaN) out of the discarded branch
        total = tl.where(
            finite,
            total * tl.exp2((best - shift) * 1.4426950408889634) + tl.exp2((x - shift) * 1.4426950408889634),
            0.0,
        )
        best = new_best
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, 0)
    top_col = tl.min(tl.where(best == top, best_col, 2147483647), 0)
    top_col = tl.where(top_col == 2147483647, start, top_col)  # every logit -inf: the first column
    lane_shift = tl.where(best > float("-inf"), best - top, float("-inf"))  # a finite lane: top is finite too
    top_sum = tl.sum(total * tl.exp2(lane_shift * 1.4426950408889634), 0)
    slot = row * tl.num_programs(1) + split
    tl.store(part_max_ptr + slot, top)
    tl.store(part_sum_ptr + slot, top_sum)
    tl.store(part_col_ptr + slot, top_col)


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_lse_reduce_kernel(part_max_ptr, part_sum_ptr, part_col_ptr, ids_ptr, lse_ptr, num_splits,
                              BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_S)
    mask = splits < num_splits
    maxes = tl.load(part_max_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row * num_splits + splits, mask=mask, other=0.0)
    cols = tl.load(part_col_ptr + row * num_splits + splits, mask=mask, other=2147483647)
    top = tl.max(maxes, 0)
    # splits cover increasing columns, so the smallest column among the maxima is the first
    tl.store(ids_ptr + row, tl.min(tl.where(maxes == top, cols, 2147483647), 0).to(tl.int64))
    split_shift = tl.where(maxes > float("-inf"), maxes - top, float("-inf"))
    top_sum = tl.sum(sums * tl.exp2(split_shift * 1.4426950408889634), 0)
    tl.store(lse_ptr + row, top + tl.log(top_sum))


def argmax_logsumexp(logits: torch.Tensor, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first argmax and logsumexp.

    Args:
        logits: (B, V) float (any of fp32/fp16/bf16), last dim contiguous; rows may be strided
            (a column slice of wider logits is fine). A row of only -inf gives column 0 and -inf.
        num_splits: programs per row, each scanning a slice of the vocabulary; by default
            enough to give every SM about two programs (tests force several).

    Returns: ``(ids, lse)``: (B,) int64 and (B,) float32. Accumulates in fp32; no host
    synchronisation. NaN logits are not supported.
    """
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    batch, vocab = logits.shape
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    lse = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return ids, lse
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    if vocab >= 2**31 - BLOCK_V:
        raise ValueError(f"vocab {vocab} too large for int32 column ids")
    most = max(1, vocab // MIN_SPLIT)
    if num_splits is None:
        num_splits = min(math.ceil(2 * num_sms(logits.device) / batch), most)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    block_v = min(BLOCK_V, 1 << (vocab - 1).bit_length())
    split_len = math.ceil(math.ceil(vocab / num_splits) / block_v) * block_v
    num_splits = math.ceil(vocab / split_len)
    # NOTE: the same two kernels and tile sizes for every batch of a vocabulary (the reduction's
    # width follows the vocabulary, not the split count), so a new batch size never compiles
    # a new variant mid-run.
    block_s = 1 << (max(num_splits, most) - 1).bit_length()
    part_max = torch.empty((batch, num_splits), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_col = torch.empty((batch, num_splits), dtype=torch.int32, device=logits.device)
    _argmax_lse_split_kernel[(batch, num_splits)](
        logits, part_max, part_sum, part_col, logits.stride(0), vocab, split_len // block_v, BLOCK_V=block_v, num_warps=4,
        **pdl_options(logits.device),
    )
    _argmax_lse_reduce_kernel[(batch,)](part_max, part_sum, part_col, ids, lse, num_splits, BLOCK_S=block_s,
                                        num_warps=1, **pdl_options(logits.device))
    return ids, lse


def argmax_logsumexp_ref(logits: torch.Tensor, num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`argmax_logsumexp` (num_splits unused)."""
    x = logits.float()
    return x.argmax(dim=-1), torch.logsumexp(x, dim=-1)
