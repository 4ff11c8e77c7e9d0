"""Small-batch kernels: steps of up to 8 tokens run each layer as q/k/v with the input norm
folded in, attention, the output projection, gate/up with the norm and SwiGLU folded in, and
down; they give what the layer-by-layer path gives, and the engine's greedy tokens stay HF's."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_model
from sluiceway_kernels.small_m_linear import small_m_linear
from sluiceway_kernels._common import interpreting
from tests.engine.test_generate import hf_greedy, make_prompts

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton kernels on CPU need TRITON_INTERPRET=1")


@pytest.fixture
def launches(monkeypatch):
    """Every small_m_linear call of the layers, by what it folded (the real kernel runs)."""
    import engine.layers.linear as linear

    seen: list[str] = []
    real = small_m_linear

    def counted(x, weight, norm_weight=None, eps=1e-6, residual=None, silu_mul=False, silu_in=False,
                norm_after=None, **kw):
        seen.append("silu+" * silu_in + "norm" * (norm_weight is not None) + "+residual" * (residual is not None)
                    + "+silu" * silu_mul + "+norm_after" * (norm_after is not None) or "plain")
        return real(x, weight, norm_weight, eps, residual, silu_mul, silu_in=silu_in, norm_after=norm_after, **kw)

    monkeypatch.setattr(linear, "small_m_linear", counted)
    return seen


def count_norms(monkeypatch) -> list[int]:
    """Every RMSNorm kernel the layers launch (their rows)."""
    import engine.layers.layernorm as layernorm

    seen: list[int] = []
    real = layernorm.rms_norm_ref

    def counted(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(layernorm, "rms_norm_ref", counted)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_small_steps_equal_the_layer_by_layer_path(tiny_model_factory, make_paged_cache, launches, arch):
    model, config = load_model(str(tiny_model_factory(arch)), dtype="float32", device="cpu")
    layers = config.num_hidden_layers
    folded, plain = make_paged_cache(config), make_paged_cache(config)
    gen = torch.Generator().manual_seed(7)
    a, b = (torch.randint(3, 300, (n,), generator=gen).tolist() for n in (30, 12))
    steps = [
        [("a", a[:20], 0)],  # 20 tokens: past the small batch, the usual path
        [("a", a[:21], 20), ("b", b[:6], 0)],  # a decode and a 6-token prompt: 7 tokens, folded
        [("a", a[:22], 21), ("b", b[:7], 6)],  # two decodes
    ]
    for i, chunks in enumerate(steps):
        del launches[:]
        assert model.use_small_batch_kernels(True) == layers
        got = folded.step(model, chunks)
        model.use_small_batch_kernels(False)
        want = plain.step(model, chunks)
        expected = [] if i == 0 else ["norm", "plain", "norm+residual+silu", "plain"] + [
            "norm+residual", "plain", "norm+residual+silu", "plain"] * (layers - 1)
        assert launches == expected
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_layers_with_biases_keep_the_usual_path(tiny_model_factory):
    model, _ = load_model(str(tiny_model_factory("qwen2")), dtype="float32", device="cpu")  # q/k/v biases
    assert model.use_small_batch_kernels(True) == 0


@pytest.mark.parametrize("layer", ["five kernels", "norms in o and down"])
def test_greedy_tokens_stay_hfs(tiny_model_factory, launches, monkeypatch, layer):
    """The five-kernel layer (``small_batch_kernels``), and o and down on small_m_linear with
    the norms after them and SiLU-mul folded in, run under the interpreter: through the engine's
    decode steps, HF's greedy tokens."""
    import engine.layers.linear as linear_layers

    import engine.models.llama as llama

    five = layer == "five kernels"
    monkeypatch.setattr(linear_layers, "SMALL_M_INTERPRETED", not five)
    monkeypatch.setattr(llama, "SMALL_M_FOLDS", ("silu_in", "norm_after"))
    path = tiny_model_factory("llama")
    llm = LLM(str(path), device="cpu", swap_space=0, block_size=8, max_num_seqs=4, small_batch_kernels=five)
    assert all(layer.small_batch_kernels if five else layer.folds_norms
               for layer in llm.llm_engine.executor.runner.model.model.layers)
    prompts = make_prompts(llm.llm_engine.vocab_size, n=4, seed=2 if five else 3)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    expected, _ = hf_greedy(path, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert set(launches) == ({"norm", "plain", "norm+residual", "norm+residual+silu"} if five else
                             {"+residual+norm_after", "silu++residual+norm_after"})  # the decode steps took them
    llm.shutdown()


ALL_FOUR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.mark.parametrize("projections, folds", [
    *((("o_proj", "down_proj"), folds) for folds in [(), ("silu_in",), ("norm_after",), ("silu_in", "norm_after")]),
    (ALL_FOUR, ()),
])
def test_chosen_projections_alone_take_small_m_linear(tiny_model_factory, make_paged_cache, launches, monkeypatch,
                                                      projections, folds):
    """``SMALL_M_PROJECTIONS`` with the five-kernel layer off: o and down (or all four) run
    ``small_m_linear`` at up to SMALL_BATCH_ROWS tokens and F.linear past them; the same outputs.
    With ``SMALL_M_FOLDS`` SiLU-mul runs in down's launch ("silu_in") and the norm after each in
    its launch ("norm_after": every norm but the first layer's input norm)."""
    import engine.layers.linear as linear_layers
    import engine.models.llama as llama

    monkeypatch.setattr(llama, "SMALL_M_PROJECTIONS", projections)
    monkeypatch.setattr(llama, "SMALL_M_FOLDS", folds)
    monkeypatch.setattr(linear_layers, "SMALL_M_INTERPRETED", True)
    model, config = load_model(str(tiny_model_factory("llama")), dtype="float32", device="cpu")
    norms = count_norms(monkeypatch)
    linears = [linear for layer in model.model.layers for linear in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    chosen = [linear.small_m_rows for linear in linears]
    assert chosen == [llama.SMALL_BATCH_ROWS * (name in projections) for name in ALL_FOUR] * config.num_hidden_layers
    small, usual = make_paged_cache(config), make_paged_cache(config)
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(3, 300, (n,), generator=gen).tolist() for n in (30, 12))
    steps = [[("a", a[:20], 0)], [("a", a[:21], 20), ("b", b[:6], 0)], [("a", a[:22], 21), ("b", b[:7], 6)]]
    for i, chunks in enumerate(steps):
        del launches[:], norms[:]
        got = small.step(model, chunks)
        after = "norm_after" in folds
        per_layer = ["plain"] * (projections == ALL_FOUR) + ["+residual+norm_after" if after else "plain"]
        per_layer += ["plain"] * (projections == ALL_FOUR)
        per_layer += ["silu+" * ("silu_in" in folds) + ("+residual+norm_after" if after else "") or "plain"]
        assert launches == ([] if i == 0 else per_layer * config.num_hidden_layers)
        assert len(norms) == (1 if after and i else 2 * config.num_hidden_layers + 1)
        for linear, rows in zip(linears, chosen):
            linear.small_m_rows = 0
        want = usual.step(model, chunks)
        for linear, rows in zip(linears, chosen):
            linear.small_m_rows = rows
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
