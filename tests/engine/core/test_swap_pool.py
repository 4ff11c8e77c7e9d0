"""The swap pool's chunks, its geometry and the preemption cost model: plain Python, no model."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.block_pool import BlockPool
from engine.core.swap import PreemptionCostModel
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams


# ----- pools in chunks (plain Python) ---------------------------------------------------
def test_pool_grows_without_moving_blocks_and_packs_low_chunks():
    pool = BlockPool(8, caching=True, chunk_blocks=4)
    a = [pool.allocate() for _ in range(3)]
    assert a == [0, 1, 2] and pool.num_chunks == 2
    assert pool.resize(17) == 16 and pool.num_free == 13  # rounded down to whole chunks
    pool.release(1)
    assert [pool.allocate() for _ in range(3)] == [3, 1, 4]  # chunk 0 first: untouched, then recycled
    assert pool.num_used_chunks == 2


def test_pool_shrinks_only_free_chunks_from_the_end_and_forgets_their_hashes():
    pool = BlockPool(12, caching=True, chunk_blocks=4)
    ids = [pool.allocate() for _ in range(9)]  # chunks 0, 1 full; block 8 in chunk 2
    pool.register(ids[5], b"h5")
    pool.release(ids[5])  # free, still cached
    assert pool.resize(0) == 12, "chunk 2 holds block 8"
    pool.release(ids[8])
    for b in ids[:5] + ids[6:8]:
        pool.release(b)
    assert pool.lookup(b"h5") == ids[5]
    assert pool.resize(4) == 4 and pool.lookup(b"h5") is None and pool.num_free == 4
    assert len(pool.ref_counts) == 4 and pool.block_hash[:4] == [None] * 4
    assert pool.resize(8) == 8 and pool.allocate() == 0


def test_chunk_geometry():
    from types import SimpleNamespace

    from engine.core.swap import swap_chunk_blocks, swap_pool_blocks

    def config(swap_bytes, block_bytes):  # the EngineConfig fields the geometry reads
        return SimpleNamespace(cache=SimpleNamespace(swap_bytes=swap_bytes), kv_bytes_per_block=block_bytes)

    mib = 1 << 20
    big = config(4 << 30, 2 * mib)
    assert swap_chunk_blocks(big) == 128  # 256 MiB
    assert swap_pool_blocks(4 << 30, big) == 2048 and swap_pool_blocks(300 * mib, big) == 128
    small = config(600 * mib, mib)
    assert swap_chunk_blocks(small) == 128  # a quarter, down to a power of two: 128 MiB
    tiny = config(3 * mib, mib)  # a quarter is less than a block: chunks of one block
    assert swap_chunk_blocks(tiny) == 1 and swap_pool_blocks(3 * mib, tiny) == 3
    off = config(0, 2 * mib)
    assert swap_chunk_blocks(off) == 128 and swap_pool_blocks(0, off) == 0


# ----- the cost model (plain Python) ----------------------------------------------------
def _seq_with_blocks(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence("s", 0, list(tokens), len(tokens), SamplingParams())
    cached = bm.find_cached_prefix(seq)
    bm.allocate(seq, len(tokens) - len(cached) * bm.block_size, cached)
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


def test_cost_model_weighs_copies_against_prefill():
    bm = BlockManager(4, 32, 32)
    seq = _seq_with_blocks(bm, list(range(1, 17)))  # 4 full blocks
    assert bm.num_swap_out_copies(seq) == 4 and bm.num_recompute_tokens(seq) == 16
    fast_link = PreemptionCostModel(block_bytes=1000, swap_bytes_per_s=1e9, prefill_tokens_per_s=1e3)
    slow_link = PreemptionCostModel(block_bytes=1000, swap_bytes_per_s=1e3, prefill_tokens_per_s=1e9)
    assert fast_link.prefer_swap(seq, bm) and not slow_link.prefer_swap(seq, bm)
    assert fast_link.swap_seconds(4) == pytest.approx(2 * 4 * 1000 / 1e9)


def test_cost_model_counts_only_what_each_choice_would_redo():
    bm = BlockManager(4, 32, 32)
    shared = list(range(1, 9))
    other = _seq_with_blocks(bm, shared + [50, 51])
    seq = _seq_with_blocks(bm, shared + [60, 61, 62, 63, 64])
    assert bm.num_recompute_tokens(seq) == 13 - 8  # the shared 2 blocks stay on the GPU with `other`
    bm.swap_out(other)
    other.status = SequenceStatus.SWAPPED
    assert bm.num_swap_out_copies(seq) == 4 - 2  # the shared 2 blocks are already in the CPU pool
