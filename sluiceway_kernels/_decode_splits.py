"""The decode kernel's host-side choices (``paged_decode_attention.launch_decode``): tile and
pipeline per dtype, and how many programs may share one context (splits)."""

from __future__ import annotations

import math

MIN_PARTITION = 128  # tokens: the shortest piece of a context longer than SHORT_CONTEXT one program reads
# NOTE: a context up to this long splits into one-tile pieces instead. In a CUDA graph on an
# H200 (llama3-8b heads, batch 1, docs/BENCHMARKS.md) a 384-token context took 11.0 us per
# layer in 64-token pieces against 13.1 in 128-token ones; at 2048 tokens 128-token pieces
# were fastest (17.3 us, against 22.1 in 64-token and 17.9 in 256-token pieces).
SHORT_CONTEXT = 512
PROGRAMS_PER_SM = 2  # programs the splits aim to give each SM (choose_splits)


def decode_config(head_dim: int, group: int, kv_itemsize: int = 2, q_itemsize: int = 2,
                  whole_contexts: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N kv positions per tile, num_warps, num_stages) for the partition kernel;
    ``whole_contexts``: one program walks each (sequence, kv head)'s whole context (no split).

    NOTE: over a float8 cache, half-precision queries take tiles twice as long, so each
    moves the bytes of a bf16 tile. On an H200 (llama3-8b heads, docs/BENCHMARKS.md) that
    matched bf16's time from 1 to 256 sequences, where 64-row float8 tiles took up to 1.4x
    as long at 32-64 sequences; at 512 sequences it is 9% slower than bf16. fp32 queries
    keep 64 rows: their widened 128-row tiles would need more shared memory than Ada has.
    Where every program walks a whole context (big batches), small float8 tiles in programs of
    two warps with five stages in flight read fastest: in a CUDA graph on an H100 at 384 x 640,
    0.204 ms (2.47 TB/s, 82% of copy) against 0.250 ms for 128-row tiles of four warps
    (2026-12-06: `bench.kernels --sweep`); at 1 x 2,048 (16 splits of 128 tokens) the 128-row
    tiles were the fastest.
    """
    block_n = 64 if head_dim <= 128 else 32
    if kv_itemsize == 1 and q_itemsize == 2:
        if whole_contexts and head_dim <= 128:
            return 32, 2, 5
        return block_n * 2, 4, 2
    return block_n, 4, 2


def choose_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int, block_n: int = 64) -> int:
    """How many programs may share one (sequence, kv head)'s context, from host-side sizes only.

    NOTE: enough splits to give every SM about PROGRAMS_PER_SM programs, never more than the pieces the
    kernel cuts the longest context into (``block_n`` tokens up to SHORT_CONTEXT, then
    MIN_PARTITION); big batches run one program per sequence and kv head. The kernel then
    sizes the splits from each sequence's own length on the device.
    """
    want = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, batch * num_kv_heads))
    longest = max(1, max_context_len)
    pieces = max(math.ceil(min(longest, SHORT_CONTEXT) / block_n), math.ceil(longest / MIN_PARTITION))
    return max(1, min(want, pieces))
