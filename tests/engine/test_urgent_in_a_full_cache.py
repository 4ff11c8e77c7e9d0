"""Rank preemption in a real engine (tiny model, CPU): an urgent request does not wait behind a
full cache, and nobody's output changes (docs/SWAP.md)."""

from __future__ import annotations

import random

import pytest
import transformers

from engine import LLM, LLMEngine, SamplingParams

BULK = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
URGENT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 6 bulk requests that want 8 blocks each at full length; the cache holds 24 blocks
FULL = dict(device="cpu", block_size=8, max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks_override=24,
            swap_space=64 * 4096 / 2**30, enable_prefix_caching=False)
ARRIVES_AT = 5  # the step before which the urgent request is added
MAX_WAIT = 3  # steps from its arrival to its first token (async scheduling reports one step late)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama", seed=3))


@pytest.fixture(scope="module")
def prompts(model):
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(7)]  # six bulk, one urgent


@pytest.fixture(scope="module")
def unconstrained(model, prompts):
    llm = LLM(model, device="cpu", block_size=8, swap_space=0)
    outs = llm.generate(prompts, [BULK] * 6 + [URGENT], use_tqdm=False)
    return {str(i): o.outputs[0].token_ids for i, o in enumerate(outs)}


def run(model, prompts, **kwargs) -> tuple[dict[str, list[int]], int | None, object]:
    """The bulk requests, then the urgent one before step ``ARRIVES_AT``: every output, the
    steps the urgent one waited for its first token, and the engine's stats."""
    engine = LLMEngine(model=model, **FULL, **kwargs)
    for i in range(6):
        engine.add_request(str(i), prompts[i], BULK, priority=0)
    done: dict[str, list[int]] = {}
    step, first_token_at = 0, None
    while engine.has_unfinished_requests() or step <= ARRIVES_AT:
        if step == ARRIVES_AT:
            engine.add_request("6", prompts[6], URGENT, priority=10)
        for out in engine.step():
            if out.request_id == "6" and first_token_at is None and out.outputs[0].token_ids:
                first_token_at = step
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    stats = engine.get_stats()
    engine.shutdown()
    return done, None if first_token_at is None else first_token_at - ARRIVES_AT, stats


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_urgent_request_gets_its_first_token_within_a_few_steps(model, prompts, unconstrained, mode):
    done, waited, stats = run(model, prompts, preemption_mode=mode)
    assert waited is not None and waited <= MAX_WAIT, f"waited {waited} steps"
    assert stats.num_rank_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_outs > 0 and stats.num_recomputes == 0
    else:
        assert stats.num_recomputes > 0 and stats.num_swap_outs == 0
    assert done == unconstrained  # token for token, every request


def test_fcfs_waits_behind_the_cache_and_keeps_the_outputs(model, prompts, unconstrained):
    done, waited, stats = run(model, prompts, preemption_mode="swap", scheduling_policy="fcfs")
    assert stats.num_rank_preemptions == 0 and waited > 4 * MAX_WAIT
    assert done == unconstrained
