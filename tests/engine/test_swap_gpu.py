"""Swap on a CUDA GPU: batched copies round-trip through pinned chunks, the compute stream
waits for exactly what it must, and greedy output under swap pressure equals output with
room for everything. Needs no conftest (the GPU scripts run pytest with --noconftest)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.shape import ModelShape
from engine.runner.cache_engine import CacheEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def llama8b_like_cache(num_blocks: int, chunk_blocks: int = 128) -> CacheEngine:
    """Blocks of llama3-8b's KV geometry (2 MiB in bf16), so copies take real time."""
    shape = ModelShape(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                       intermediate_size=14336, vocab_size=128256)
    return CacheEngine(shape, block_size=16, num_gpu_blocks=num_blocks, cpu_chunk_blocks=chunk_blocks,
                       dtype=torch.bfloat16, device=CUDA)


def host_block(cache: CacheEngine, block_id: int) -> torch.Tensor:
    return cache.cpu_chunks[block_id // cache.chunk_blocks][block_id % cache.chunk_blocks]


def test_round_trip_through_pinned_chunks():
    cache = llama8b_like_cache(64, chunk_blocks=8)
    cache.gpu.normal_()
    original = cache.gpu.clone()
    rng = random.Random(0)
    gpu_ids = rng.sample(range(64), 24)
    cpu_ids = sorted(rng.sample(range(40), 24))  # runs and gaps over five chunks
    cache.swap_out(torch.tensor(list(zip(gpu_ids, cpu_ids))))
    cache.synchronize()
    assert all(t is None or t.is_pinned() for t in cache.cpu_chunks)
    for g, c in zip(gpu_ids, cpu_ids):
        assert torch.equal(host_block(cache, c), original[:, :, g].cpu())
    cache.gpu.zero_()
    targets = rng.sample(range(64), 24)
    cache.swap_in(torch.tensor(list(zip(cpu_ids, targets))))
    torch.cuda.synchronize()
    for g, t in zip(gpu_ids, targets):
        assert torch.equal(cache.gpu[:, :, t], original[:, :, g])
    cache.truncate(0)
    assert cache.cpu_chunks == [] and cache.resident_bytes == 0



def test_pool_chunks_are_registered_host_memory_given_back_off_the_step_loop():
    """Chunks pinned while the pool grows come from cudaHostRegister, not torch's caching host
    allocator (whose cudaHostAlloc / cudaFreeHost hold up the step loop's CUDA calls); a
    shrink hands them back on a thread of its own, after the copies that used them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats()["allocated_bytes.current"] if stats else None
    cache = llama8b_like_cache(64, chunk_blocks=8)  # 16 MiB chunks
    cache.reserve(4)
    cache.wait_pinned()
    chunks = list(cache.cpu_chunks)
    assert len(chunks) == 4 and all(t is not None and t.is_pinned() for t in chunks)
    if stats:
        assert stats()["allocated_bytes.current"] - before < 4 * 16 << 20, "chunks came from the caching allocator"
    cache.gpu.normal_()
    cache.swap_out(torch.tensor([[g, 8 * 3 + g] for g in range(8)]))  # into the last chunk
    last_copy = cache._done
    cache.truncate(3)
    assert len(cache.cpu_chunks) == 3 and cache.resident_bytes == 3 * 16 << 20
    cache.wait_released()
    assert last_copy.query(), "released only after the copies into the chunk"
    assert not chunks[3].unregister.alive, "its memory was unregistered"
    assert chunks[0].unregister.alive


def test_a_chunk_registered_in_pieces_round_trips_copies_cut_at_them():
    cache = llama8b_like_cache(64, chunk_blocks=8)  # 16 MiB chunks
    cache.piece_blocks = 3  # 6 MiB pieces: 0-2, 3-5, 6-7
    cache.reserve(2)
    cache.wait_pinned()
    chunk = cache.cpu_chunks[0]
    assert chunk.data_ptr() % 4096 == 0 and chunk.is_pinned()
    assert len(chunk.unregister.peek()[2][0]) == 3, "registered piece by piece"
    cache.gpu.normal_()
    original = cache.gpu.clone()
    cpu_ids = list(range(1, 14))
    cache.swap_out(torch.tensor([[g, c] for g, c in zip(range(13), cpu_ids)]))
    cache.synchronize()
    assert cache.counters.copies == 5  # 1-2 | 3-5 | 6-7 of chunk 0, 8-10 | 11-13 of chunk 1
    cache.gpu.zero_()
    cache.swap_in(torch.tensor([[c, 20 + g] for g, c in zip(range(13), cpu_ids)]))
    torch.cuda.synchronize()
    assert torch.equal(cache.gpu[:, :, 20:33], original[:, :, :13])
    cache.truncate(0)
    cache.wait_released()
    assert not chunk.unregister.alive


def test_compute_stream_waits_for_gathers_and_landed_blocks():
    cache = llama8b_like_cache(1024)
    cache.gpu.normal_()
    original = cache.gpu[:, :, :512].clone()
    out_pairs = torch.stack([torch.arange(512), torch.arange(512)], dim=1)
    cache.swap_out(out_pairs)
    cache.gpu.fill_(7)  # queued on the compute stream at once, like a forward writing reused blocks
    cache.synchronize()
    torch.cuda.synchronize()
    for b in (0, 255, 511):
        assert torch.equal(host_block(cache, b), original[:, :, b].cpu())
    in_pairs = torch.stack([torch.arange(512), torch.arange(512, 1024)], dim=1)
    cache.swap_in(in_pairs)
    seen = cache.gpu[:, :, 512:].clone()  # read on the compute stream right after, like the forward
    torch.cuda.synchronize()
    assert torch.equal(seen, original)


def test_greedy_under_swap_pressure_matches_roomy(tmp_path):
    from engine.models.tiny import build_tiny_model

    path = str(build_tiny_model(tmp_path / "tiny", arch="llama", seed=3))
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(16)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))]
               for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", block_size=8, enforce_eager=True)
    roomy = LLM(path, swap_space=0, **common)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()
    tight = LLM(path, max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=16,
                swap_space=64 * 4096 / 2**30, preemption_mode="swap", **common)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    stats = tight.llm_engine.get_stats()
    assert stats.num_swap_outs > 0 and stats.num_recomputes == 0, "the block budget was meant to swap"
    assert got == expected
    assert tight.llm_engine.resize_swap_pool(0) == 0
    tight.shutdown()
