"""The cache engine's batched swap copies, on the CPU."""

from __future__ import annotations

import torch

from engine.models.shape import ModelShape
from engine.runner.cache_engine import CacheEngine


# ----- the cache engine's copies (CPU) --------------------------------------------------
def test_cache_engine_batched_copies_round_trip_across_chunks():
    shape = ModelShape(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4, hidden_size=8, intermediate_size=16,
                       vocab_size=10)
    cache = CacheEngine(shape, block_size=4, num_gpu_blocks=32, cpu_chunk_blocks=5, dtype=torch.float32,
                        device=torch.device("cpu"))
    cache.gpu.copy_(torch.randn_like(cache.gpu))
    original = cache.gpu.clone()
    assert cache.cpu_chunks == [] and cache.resident_bytes == 0  # nothing until the first copy
    gpu_ids = [3, 17, 0, 9, 30, 12, 21, 5]
    cpu_ids = [11, 2, 3, 4, 10, 12, 13, 14]  # runs: 2-4 (chunk 0), 10-14 (chunk 2), none in chunk 1
    cache.swap_out(torch.tensor(list(zip(gpu_ids, cpu_ids))))
    assert [t is not None for t in cache.cpu_chunks] == [True, False, True]
    assert cache.counters.copies == 2 and cache.counters.blocks_out == 8
    for g, c in zip(gpu_ids, cpu_ids):
        torch.testing.assert_close(cache.cpu_chunks[c // 5][c % 5], original[:, :, g])
    cache.gpu.zero_()
    targets = [1, 2, 4, 6, 7, 8, 25, 31]
    cache.swap_in(torch.tensor(list(zip(cpu_ids, targets))))
    for g, t in zip(gpu_ids, targets):
        torch.testing.assert_close(cache.gpu[:, :, t], original[:, :, g])
    untouched = [b for b in range(32) if b not in targets]
    assert not cache.gpu[:, :, untouched].any()
    cache.truncate(1)
    assert [t is not None for t in cache.cpu_chunks] == [True]


def test_swap_pool_chunks_are_pinned_ahead_of_the_copies_that_use_them():
    shape = ModelShape(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4, hidden_size=8, intermediate_size=16,
                       vocab_size=10)
    cache = CacheEngine(shape, block_size=4, num_gpu_blocks=32, cpu_chunk_blocks=5, dtype=torch.float32,
                        device=torch.device("cpu"), pin_ahead=True)
    cache.reserve(2, wait=True)  # start-up: the configured pool, before anything runs
    assert [t is not None for t in cache.cpu_chunks] == [True, True] and cache.counters.chunks_pinned_ahead == 2
    cache.reserve(4)  # the pool grew: pinned in the background
    cache.wait_pinned()
    assert [t is not None for t in cache.cpu_chunks] == [True] * 4 and cache.counters.chunks_pinned_ahead == 4
    cache.gpu.copy_(torch.randn_like(cache.gpu))
    cache.staging_blocks = 2  # five staging rounds, gathered two ahead of their host copies
    gpu_ids, cpu_ids = [4, 9, 0, 31, 7, 12, 3, 25, 16], [0, 1, 2, 3, 4, 5, 6, 7, 19]
    cache.swap_out(torch.tensor(list(zip(gpu_ids, cpu_ids))))
    for g, c in zip(gpu_ids, cpu_ids):
        torch.testing.assert_close(cache.cpu_chunks[c // 5][c % 5], cache.gpu[:, :, g])
    assert cache.counters.chunks_pinned_in_step == 0, "the copy found its chunks ready"
    assert cache.counters.host_s > 0
    cache.truncate(1)
    assert len(cache.cpu_chunks) == 1
    cache.reserve(2)
    cache.wait_pinned()
    assert [t is not None for t in cache.cpu_chunks] == [True, True]
    lazy = CacheEngine(shape, block_size=4, num_gpu_blocks=32, cpu_chunk_blocks=5, dtype=torch.float32,
                       device=torch.device("cpu"))  # on a CPU device by default: on the first copy
    lazy.reserve(2, wait=True)
    assert lazy.cpu_chunks == []
    lazy.swap_out(torch.tensor([[0, 7]]))
    assert lazy.counters.chunks_pinned_in_step == 1


def test_copies_are_cut_at_the_registered_pieces_of_a_chunk():
    """A chunk's host memory is registered piece by piece (one cudaHostRegister holds up the
    step loop's CUDA calls while it runs), and a copy must stay within one registration."""
    shape = ModelShape(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4, hidden_size=8, intermediate_size=16,
                       vocab_size=10)
    cache = CacheEngine(shape, block_size=4, num_gpu_blocks=32, cpu_chunk_blocks=8, dtype=torch.float32,
                        device=torch.device("cpu"))
    cache.piece_blocks = 3  # pieces 0-2, 3-5, 6-7 of each chunk
    cache.gpu.copy_(torch.randn_like(cache.gpu))
    cpu_ids = list(range(1, 12))  # 1-2 | 3-5 | 6-7 ‖ 8-10 | 11
    cache.swap_out(torch.tensor([[g, c] for g, c in zip(range(11), cpu_ids)]))
    assert cache.counters.copies == 5
    for g, c in zip(range(11), cpu_ids):
        torch.testing.assert_close(cache.cpu_chunks[c // 8][c % 8], cache.gpu[:, :, g])


def test_pieces_are_whole_pages_of_whole_blocks():
    from engine.runner.host_memory import PAGE, piece_blocks

    for block_bytes in (2 << 20, 3 * 4096, 512, 6144, 12_345):
        n = piece_blocks(block_bytes, 16 << 20)
        assert n >= 1 and n * block_bytes % PAGE == 0
        assert n * block_bytes <= max(16 << 20, block_bytes * PAGE)
    assert piece_blocks(2 << 20, 16 << 20) == 8
