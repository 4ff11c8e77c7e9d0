"""Fused sampling from logits: temperature, exponential-race noise and argmax in one pass.

Drawing token i with probability softmax(logits / T)_i is the same as taking
argmax_i(logits_i / T - log(E_i)) with E_i ~ Exp(1) independent (the Gumbel-max trick in
the "exponential race" form). The kernel reads each logit once, makes E_i on the fly from a
counter-based generator, and never materialises probabilities or noise.

The noise for row b, column i is a pure function of (seeds[b], i): Philox4x32-10 keyed by
the 64-bit seed with counter (i, 0, 0, 0), first output word, top 23 bits as the uniform
u = (r + 0.5) / 2**23 in (0, 1). The reference rebuilds the same numbers in torch, so the
kernel and the reference agree token for token on every device.
"""

from __future__ import annotations

import math

import torch

from sluiceway_kernels._common import FLOAT_DTYPES, check_same_device, check_shape, check_tensor, num_sms, tl, triton

BLOCK_V = 1024
MIN_SPLIT = 8192  # columns: a split smaller than this costs more than it saves
# NOTE: a row whose temperature is below this is greedy, as in vLLM's sampler (its epsilon): a
# positive one below about 1e-37 would overflow logits / T to inf and pick among the infs
GREEDY_BELOW = 1e-5


@triton.jit
def _scan_columns(row_logits, start, end, temperature, seed, NOISE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Best score and its first column over [start, end)."""
    lanes = tl.arange(0, BLOCK_V)
    # Lane-wise running best; a later tile wins a lane only when strictly greater, so each
    # lane keeps its first maximum and the pick below is the first maximum overall.
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    best_col = tl.full((BLOCK_V,), 2147483647, tl.int32)
    for tile in range(start, end, BLOCK_V):
        cols = tile + lanes
        mask = cols < end
        score = tl.load(row_logits + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if NOISE:
            bits = tl.randint(seed, cols)  # (BLOCK_V,) uint32
            u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
            score = tl.where(mask, score / temperature - tl.log(-tl.log(u)), float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, 0)
    top_col = tl.min(tl.where(best == top, best_col, 2147483647), 0)
    top_col = tl.where(top_col == 2147483647, start, top_col)  # every score -inf: first column
    return top, top_col


@triton.jit(do_not_specialize_on_alignment=["temperatures_ptr", "seeds_ptr"])
def _sample_split_kernel(
    logits_ptr, temperatures_ptr, seeds_ptr, out_ptr, part_val_ptr, part_idx_ptr,
    stride_l, vocab, split_len,
    BLOCK_V: tl.constexpr, WRITE_FINAL: tl.constexpr, GREEDY_BELOW: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    row_logits = logits_ptr + row.to(tl.int64) * stride_l
    start = split * split_len
    end = tl.minimum(start + split_len, vocab)
    if temperature >= GREEDY_BELOW:
        top, top_col = _scan_columns(row_logits, start, end, temperature, seed, True, BLOCK_V)
    else:  # greedy
        top, top_col = _scan_columns(row_logits, start, end, temperature, seed, False, BLOCK_V)
    if WRITE_FINAL:
        tl.store(out_ptr + row, top_col.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * tl.num_programs(1) + split, top)
        tl.store(part_idx_ptr + row * tl.num_programs(1) + split, top_col)


@triton.jit(do_not_specialize=["num_splits"])
def _sample_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_S)
    mask = splits < num_splits
    vals = tl.load(part_val_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    cols = tl.load(part_idx_ptr + row * num_splits + splits, mask=mask, other=2147483647)
    top = tl.max(vals, 0)
    # splits cover increasing columns, so the smallest column among the maxima is the first
    tl.store(out_ptr + row, tl.min(tl.where(vals == top, cols, 2147483647), 0).to(tl.int64))


def sample_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature); greedy where it is below 1e-5.

    Args:
        logits: (B, V) float (fp32 usually), last dim contiguous. Filtered-out tokens (top-k,
            top-p, min-p) should be -inf; they are never drawn.
        temperatures: (B,) float. A row with temperature below ``GREEDY_BELOW`` (1e-5, vLLM's
            epsilon) takes the first argmax.
        seeds: (B,) int64. Row b's noise depends only on seeds[b]: give every row a fresh
            seed each step (e.g. from a per-request counter), and the same seed to replay a draw.
        out: optional (B,) int64.
        num_splits: programs per row, each scanning a slice of the vocabulary; by default
            enough to give every SM about two programs (tests force several).

    Returns: ``out``, (B,) int64 token ids. No host synchronisation (CUDA-graph safe).
    """
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    check_tensor("temperatures", temperatures, 1, FLOAT_DTYPES)
    check_tensor("seeds", seeds, 1, (torch.int64,))
    batch, vocab = logits.shape
    check_shape("temperatures", temperatures, (batch,))
    check_shape("seeds", seeds, (batch,))
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    else:
        check_tensor("out", out, 1, (torch.int64,))
        check_shape("out", out, (batch,))
    check_same_device(logits=logits, temperatures=temperatures, seeds=seeds, out=out)
    if batch == 0:
        return out
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    if vocab >= 2**31 - BLOCK_V:
        raise ValueError(f"vocab {vocab} too large for int32 column ids")

    if num_splits is None:
        # NOTE: small batches split the vocabulary so every SM has about two rows' worth of work.
        num_splits = max(1, min(math.ceil(2 * num_sms(logits.device) / batch), vocab // MIN_SPLIT))
    elif num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    block_v = min(BLOCK_V, 1 << (vocab - 1).bit_length())
    split_len = math.ceil(math.ceil(vocab / num_splits) / block_v) * block_v
    num_splits = math.ceil(vocab / split_len)
    if num_splits == 1:
        _sample_split_kernel[(batch, 1)](
            logits, temperatures, seeds, out, out, out,
            logits.stride(0), vocab, split_len, BLOCK_V=block_v, WRITE_FINAL=True, GREEDY_BELOW=GREEDY_BELOW,
            num_warps=4,
        )
        return out
    part_val = torch.empty((batch, num_splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((batch, num_splits), dtype=torch.int32, device=logits.device)
    _sample_split_kernel[(batch, num_splits)](
        logits, temperatures, seeds, out, part_val, part_idx,
        logits.stride(0), vocab, split_len, BLOCK_V=block_v, WRITE_FINAL=False, GREEDY_BELOW=GREEDY_BELOW,
        num_warps=4,
    )
    block_s = 1 << (num_splits - 1).bit_length()
    _sample_reduce_kernel[(batch,)](part_val, part_idx, out, num_splits, BLOCK_S=block_s, num_warps=1)
    return out


_M32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b for a 32-bit constant and uint32 values in int64."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_part = a * b_lo  # < 2**48
    mid = a * b_hi + (lo_part >> 16)  # a * b == mid * 2**16 + (lo_part & 0xFFFF)
    return mid >> 16, ((mid & 0xFFFF) << 16 | (lo_part & 0xFFFF)) & _M32


def philox_uint32_ref(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10, first output word, for key = seeds and counter = (counters, 0, 0, 0).

    seeds (int64) and counters broadcast together; the words come back as int64 in [0, 2**32).
    """
    k0 = seeds.long() & _M32
    k1 = (seeds.long() >> 32) & _M32
    c0 = torch.broadcast_to(counters.long(), torch.broadcast_shapes(seeds.shape, counters.shape))
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _mul_hi_lo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0


# Gumbel noise -log(-log(u)) for u in [2**-24, 1 - 2**-24] lies in [-2.82, 16.64]: a token whose
# logit / T is more than 19.46 below the row's best can never win the race.
_NOISE_SPAN = 20.0


def sample_from_logits_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`sample_from_logits` (num_splits unused): same noise, same tokens.

    Noise is generated only for the tokens that can still win (see _NOISE_SPAN), which on
    real logits is a small part of the vocabulary; the result is the same as with all of it.
    """
    x = logits.float()
    t = temperatures.float()[:, None]  # (B, 1)
    sampled = t >= GREEDY_BELOW  # (B, 1)
    scaled = torch.where(sampled, x / t, x)  # (B, V)
    best = scaled.max(dim=1, keepdim=True).values  # (B, 1)
    rows, cols = torch.nonzero(sampled & (scaled >= best - _NOISE_SPAN), as_tuple=True)  # (N,)
    bits = philox_uint32_ref(seeds[rows], cols)  # (N,)
    scores = torch.where(sampled, torch.full_like(scaled, float("-inf")), scaled)
    u = ((bits >> 9).float() + 0.5) * 2.0**-23
    scores[rows, cols] = scaled[rows, cols] - torch.log(-torch.log(u))
    result = scores.argmax(dim=1)
    if out is None:
        return result
    out.copy_(result)
    return out
