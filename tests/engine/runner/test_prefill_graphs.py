"""Piecewise prompt steps: the pieces either side of attention, run over the static buffers at
a padded size, give what the model's own forward gives (eagerly here: on a GPU the same pieces
are captured, and tests/engine/test_gpu.py holds the graphs to the eager engine)."""

from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.runner.prefill_graphs import BETWEEN_LAYERS, PrefillGraphs, prefill_token_sizes
from sluiceway_kernels._common import interpreting


class Piecewise:
    """The model as ``PagedCache.step`` calls it, its forward through the pieces."""

    def __init__(self, model, graphs: PrefillGraphs, between=None):
        self.model, self.graphs, self.between = model, graphs, between

    def __call__(self, input_ids, positions, ctx):
        hidden = self.graphs.run(input_ids, positions, ctx, self.between)
        assert hidden is not None, f"{input_ids.shape[0]} tokens: no size holds them"
        return hidden

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def test_sizes_pad_a_step_by_at_most_an_eighth_past_128_tokens():
    sizes = prefill_token_sizes(2048)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    for tokens in range(129, 2049):
        padded = next(s for s in sizes if s >= tokens)
        assert padded - tokens < tokens / 8 + 1, tokens
    assert prefill_token_sizes(300) == [*range(16, 257, 16), 288, 300]
    assert prefill_token_sizes(10) == [10] and prefill_token_sizes(0) == []


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not interpreting(), reason="the Triton backend on CPU needs TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q and k normed inside the first piece
def test_pieces_equal_the_models_forward_step_after_step(tiny_model_factory, make_paged_cache, arch, backend):
    model, config = load_model(str(tiny_model_factory(arch)), dtype="float32", device="cpu")
    graphs = PrefillGraphs(model, prefill_token_sizes(64), torch.float32, torch.device("cpu"), eager=True)
    piecewise, eager = make_paged_cache(config, backend=backend), make_paged_cache(config, backend=backend)
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(3, 300, (n,), generator=gen).tolist() for n in (40, 9, 30))
    steps = [
        [("a", a[:37], 0), ("b", b, 0)],  # 46 tokens, padded to 48
        [("a", a[:38], 37), ("c", c[:5], 0)],  # a decode and a short prompt: 6 rows of 16, the rest stale
        [("a", a, 38), ("b", b + c[:1], 9), ("c", c, 5)],  # decodes first, then a chunk
    ]
    for chunks in steps:
        got = piecewise.step(Piecewise(model, graphs), chunks)
        want = eager.step(model, chunks)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for (k_got, v_got), (k_want, v_want) in zip(piecewise.kv_caches, eager.kv_caches):
        torch.testing.assert_close(k_got, k_want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_got, v_want, atol=1e-5, rtol=1e-5)


def test_a_launch_of_pieces_calls_between_every_few_layers(tiny_model_factory, make_paged_cache):
    """The express lane's look for arrivals during a long launch: every ``BETWEEN_LAYERS``
    layers of the pieces, the step's outputs unchanged."""
    model, config = load_model(str(tiny_model_factory("llama", num_hidden_layers=8)), dtype="float32", device="cpu")
    graphs = PrefillGraphs(model, prefill_token_sizes(64), torch.float32, torch.device("cpu"), eager=True)
    calls = []
    chunks = [("a", list(range(3, 40)), 0), ("b", list(range(50, 59)), 0)]
    got = make_paged_cache(config).step(Piecewise(model, graphs, between=lambda: calls.append(1)), chunks)
    want = make_paged_cache(config).step(model, chunks)
    assert len(calls) == 8 // BETWEEN_LAYERS > 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_step_past_the_largest_size_is_left_to_the_eager_forward(tiny_model_factory, make_paged_cache):
    model, config = load_model(str(tiny_model_factory("llama")), dtype="float32", device="cpu")
    graphs = PrefillGraphs(model, [16, 32], torch.float32, torch.device("cpu"), eager=True)
    ids = torch.zeros(33, dtype=torch.long)
    assert graphs.run(ids, torch.arange(33), ctx=None) is None
    assert graphs.run(ids[:0], torch.arange(0), ctx=None) is None
    with pytest.raises(ValueError, match="token_sizes"):
        PrefillGraphs(model, [], torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_steps_equal_the_models_forward_and_others_take_the_pieces(tiny_model_factory, make_paged_cache,
                                                                          backend):
    """Prompt steps of up to ``max_seqs`` sequences run the whole forward over the padded
    static metadata (a prompt continuing a cached prefix too, and decodes of contexts up to
    ``max_decode_context``); a step with a longer decode, or with more sequences, takes the
    pieces; every step equals the model's own forward."""
    model, config = load_model(str(tiny_model_factory("qwen3")), dtype="float32", device="cpu")
    piecewise, eager = make_paged_cache(config, backend=backend), make_paged_cache(config, backend=backend)
    graphs = PrefillGraphs(model, prefill_token_sizes(64), torch.float32, torch.device("cpu"),
                           max_blocks_per_seq=32, max_context_len=128, max_seqs=2, max_decode_context=48,
                           eager=True)
    graphs.attach(piecewise.kv_caches, piecewise.backend)
    whole_sizes = []
    run_whole = graphs._whole_step
    graphs._whole_step = lambda size: (whole_sizes.append(size), run_whole(size))[1]
    gen = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(3, 300, (n,), generator=gen).tolist() for n in (50, 20, 12))
    steps = [
        ([("a", a[:30], 0)], [32]),  # one prompt, 30 tokens padded to 32
        ([("a", a[:45], 30), ("b", b[:9], 0)], [32]),  # a chunk over a cached prefix, and a new prompt
        ([("a", a[:46], 45), ("b", b[:20], 9)], [16]),  # a decode of context 46 first, then a chunk
        ([("a", a[:48], 46)], [16]),
        ([("a", a[:49], 48), ("c", c[:5], 0)], []),  # a decode of context 49: the pieces
        ([("a", a, 49), ("b", b + c[:3], 20), ("c", c, 5)], []),  # three prompts, past max_seqs: the pieces
        ([("c", c + b[:2], 12)], [16]),  # a short chunk after all that (stale rows in every buffer)
    ]
    for chunks, whole in steps:
        del whole_sizes[:]
        got = piecewise.step(Piecewise(model, graphs), chunks)
        want = eager.step(model, chunks)
        assert whole_sizes == whole, chunks
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for (k_got, v_got), (k_want, v_want) in zip(piecewise.kv_caches, eager.kv_caches):
        torch.testing.assert_close(k_got, k_want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_got, v_want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_through_the_graph_paths_keeps_hfs_greedy_tokens(tiny_model_factory, async_scheduling):
    """The runner's prompt steps through PrefillGraphs (its eager form: the same pieces and
    whole steps over the same static buffers, as on a GPU they are replayed) under chunked
    prefill, shared prefixes and preemption: HF's greedy tokens."""
    from engine import LLM, SamplingParams
    from tests.engine.test_generate import hf_greedy, make_prompts

    path = tiny_model_factory("llama", seed=3)
    llm = LLM(str(path), device="cpu", block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
              num_gpu_blocks_override=30, swap_space=0, preemption_mode="recompute",
              async_scheduling=async_scheduling)
    runner = llm.llm_engine.executor.runner
    config = llm.llm_engine.config
    graphs = PrefillGraphs(runner.model, prefill_token_sizes(32), torch.float32, torch.device("cpu"),
                           max_blocks_per_seq=runner.max_blocks_per_seq, max_context_len=config.model.max_model_len,
                           max_seqs=4, eager=True)
    graphs.attach(runner.cache.kv_caches, runner.backend)
    runner.prefill_graphs = graphs
    steps = {"whole": 0, "pieces": 0}
    run_whole, run_piece = graphs._whole_step, graphs._piece
    graphs._whole_step = lambda size: (steps.__setitem__("whole", steps["whole"] + 1), run_whole(size))[1]
    graphs._piece = lambda index, size: (steps.__setitem__("pieces", steps["pieces"] + (index == 0)),
                                         run_piece(index, size))[1]
    prompts = make_prompts(llm.llm_engine.vocab_size, n=10)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected, _ = hf_greedy(path, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert steps["whole"] > 0 and steps["pieces"] > 0, steps
    assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.shutdown()
