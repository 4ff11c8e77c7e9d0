"""Swap space: the chunked CPU pool, batched block copies, swap vs recompute, resizing at run time."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.core.sequence import SequenceStatus

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
    three_blocks = {**PRESSURE, "swap_space": 3 * BLOCK_BYTES / 2**30}  # chunks of one block
    llm = LLM(model, preemption_mode="swap", **three_blocks)
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
