"""Swap space: the chunked CPU pool, batched block copies, swap vs recompute, resizing at run time."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager, BlockPool
from engine.models.shape import ModelShape
from engine.runner.cache_engine import CacheEngine
from engine.core.scheduler import PreemptionCostModel
from engine.core.sequence import Sequence, SequenceStatus

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK_BYTES = 4096  # the tiny llama: 2 layers x (k, v) x 8 tokens x 2 KV heads x 16 dims x 4 bytes
# 64 blocks of swap space, in chunks of 16: 4 chunks
SWAP_GIB = 64 * BLOCK_BYTES / 2**30
# chunked prefill (32-token budget), shared prefixes, and 16 GPU blocks for 8 sequences that want up to 9
PRESSURE = dict(device="cpu", block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
                num_gpu_blocks_override=16, swap_space=SWAP_GIB)


def make_prompts(vocab_size: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; every other prompt starts with the same 16 tokens (two blocks of 8)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(16)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 40))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama", seed=3))


@pytest.fixture(scope="module")
def prompts(model):
    return make_prompts(transformers.AutoConfig.from_pretrained(model).vocab_size)


@pytest.fixture(scope="module")
def expected(model, prompts):
    """Greedy tokens from HF transformers and from an engine with room for everything."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf_tokens = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
            hf_tokens.append(gen[0, len(p):].tolist())
    roomy = tokens(LLM(model, device="cpu", block_size=8, swap_space=0).generate(prompts, GREEDY, use_tqdm=False))
    assert roomy == hf_tokens
    return hf_tokens


def run_steps(engine, on_step=None) -> dict[str, list[int]]:
    """Drive ``step()`` by hand to the end; ``on_step(engine, i)`` runs after each step."""
    done, i = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if on_step is not None:
            on_step(engine, i)
        i += 1
    return done


# ----- the engine under pressure --------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swap_matches_unconstrained_and_hf(model, prompts, expected, async_scheduling):
    llm = LLM(model, preemption_mode="swap", async_scheduling=async_scheduling, **PRESSURE)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    s = llm.llm_engine.get_stats()
    assert s.num_swap_outs > 0 and s.num_swap_ins == s.num_swap_outs, "the block budget was meant to swap"
    assert s.num_recomputes == 0
    assert s.swap_out_bytes == s.num_swapped_out_blocks * BLOCK_BYTES > 0
    assert s.swap_in_bytes == s.num_swapped_in_blocks * BLOCK_BYTES > 0
    assert s.num_cpu_blocks == 64 and s.swap_pool_bytes == 64 * BLOCK_BYTES
    assert s.num_free_cpu_blocks == s.num_cpu_blocks and s.num_free_gpu_blocks == s.num_gpu_blocks
    assert 0 < s.swap_pool_resident_bytes <= s.swap_pool_bytes
    cache = llm.llm_engine.executor.runner.cache
    assert cache.counters.blocks_out == s.num_swapped_out_blocks
    assert cache.counters.copies < cache.counters.blocks_out + cache.counters.blocks_in, "runs were batched"


def test_auto_swaps_on_this_machine(model, prompts, expected):
    llm = LLM(model, preemption_mode="auto", **PRESSURE)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    s = llm.llm_engine.get_stats()
    assert s.num_swap_outs > 0 and s.num_recomputes == 0


def test_full_pool_falls_back_to_recompute(model, prompts, expected):
    llm = LLM(model, preemption_mode="swap", max_cpu_blocks_override=3, **PRESSURE)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    s = llm.llm_engine.get_stats()
    assert s.num_cpu_blocks == 3
    assert s.num_recomputes > 0, "a 3-block pool cannot take every victim"
    assert s.num_preemptions == s.num_swap_outs + s.num_recomputes
    assert s.num_free_cpu_blocks == 3


def test_resize_while_swapped_out_keeps_sequences(model, prompts, expected):
    llm = LLM(model, preemption_mode="swap", **PRESSURE)
    engine = llm.llm_engine
    cache = engine.executor.runner.cache
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    seen = {}

    def resize_mid_flight(engine, step):
        pool = engine.block_manager.cpu
        if "shrunk" not in seen and engine.scheduler.swapped:
            held = {b for seq in engine.scheduler.swapped for b in seq.block_table}
            kept = engine.resize_swap_pool(0)  # only chunks past the last held block go
            assert kept == (max(held) // 16 + 1) * 16 * BLOCK_BYTES < 64 * BLOCK_BYTES
            assert len(cache.cpu_chunks) <= kept // (16 * BLOCK_BYTES)
            assert all(pool.ref_counts[b] > 0 for b in held)
            seen["shrunk"] = step
        elif "shrunk" in seen and "grown" not in seen:
            assert engine.resize_swap_pool(128 * BLOCK_BYTES + 5) == 128 * BLOCK_BYTES  # whole chunks
            seen["grown"] = step

    done = run_steps(engine, resize_mid_flight)
    assert "grown" in seen, "the block budget was meant to swap"
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert engine.get_stats().num_cpu_blocks == 128
    assert engine.resize_swap_pool(0) == 0  # everything is back: the whole pool can go
    assert cache.cpu_chunks == [] and engine.get_stats().swap_pool_resident_bytes == 0


def test_abort_swapped_request_frees_its_cpu_blocks(model, prompts, expected):
    engine = LLM(model, preemption_mode="swap", **PRESSURE).llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[-1]
    held = len(victim.block_table)
    free_before = engine.block_manager.cpu.num_free
    engine.abort_request(victim.request_id)
    assert victim.status is SequenceStatus.FINISHED and victim.block_table == []
    assert engine.block_manager.cpu.num_free >= free_before + 1 and held > 0
    done = run_steps(engine)
    assert victim.request_id not in done
    assert all(done[str(i)] == expected[i] for i in range(len(prompts)) if str(i) != victim.request_id)
    s = engine.get_stats()
    assert s.num_free_cpu_blocks == s.num_cpu_blocks and s.num_free_gpu_blocks == s.num_gpu_blocks


def test_resize_argument_errors(model):
    engine = LLM(model, device="cpu", block_size=8, swap_space=SWAP_GIB).llm_engine
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="num_bytes"):
            engine.resize_swap_pool(bad)


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

    def config(swap_bytes, block_bytes, cap=None):  # the EngineConfig fields the geometry reads
        return SimpleNamespace(cache=SimpleNamespace(swap_bytes=swap_bytes, max_cpu_blocks_override=cap),
                               kv_bytes_per_block=block_bytes)

    mib = 1 << 20
    big = config(4 << 30, 2 * mib)
    assert swap_chunk_blocks(big) == 128  # 256 MiB
    assert swap_pool_blocks(4 << 30, big) == 2048 and swap_pool_blocks(300 * mib, big) == 128
    small = config(600 * mib, mib)
    assert swap_chunk_blocks(small) == 128  # a quarter, down to a power of two: 128 MiB
    capped = config(4 << 30, 2 * mib, cap=3)
    assert swap_chunk_blocks(capped) == 3 and swap_pool_blocks(4 << 30, capped) == 3
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


# ----- tensor parallel: each rank swaps its own shard -----------------------------------
def test_tp2_swap_and_resize(model, prompts, expected):
    pytest.importorskip("engine.executor.parallel")
    with LLM(model, preemption_mode="swap", tensor_parallel_size=2, **PRESSURE) as llm:
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        seen = []

        def resize_mid_flight(engine, step):
            if engine.scheduler.swapped and not seen:
                seen.append(engine.resize_swap_pool(0))  # every rank drops the chunks past the held ones
            elif seen and len(seen) == 1:
                seen.append(engine.resize_swap_pool(64 * BLOCK_BYTES))

        done = run_steps(engine, resize_mid_flight)
        assert len(seen) == 2 and seen[0] < 64 * BLOCK_BYTES and seen[1] == 64 * BLOCK_BYTES
        assert [done[str(i)] for i in range(len(prompts))] == expected
        s = engine.get_stats()
        assert s.num_swap_outs > 0 and s.num_recomputes == 0
        assert s.swap_out_bytes == s.num_swapped_out_blocks * BLOCK_BYTES  # both ranks' halves
        assert engine.resize_swap_pool(0) == 0
