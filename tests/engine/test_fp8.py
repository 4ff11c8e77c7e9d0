"""``quantization="fp8"`` (W8A8) on CPU, through the exact emulation path.

The reference is written here, independently of the engine: a tensor is quantized row by
row (scale = max|row| / 448, round to float8 e4m3) and dequantized. The engine's layers
must equal the fp32 product of such operands, and its greedy tokens must equal HF
transformers run on the dequantized weights with every linear layer's input quantized per
token the same way (a forward pre-hook on each decoder ``nn.Linear``).
"""

import json

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sluiceway_kernels._common import interpreting
from bench.roofline import ModelCounts
from tests.engine.test_generate import make_prompts

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quant_rows(t: torch.Tensor) -> torch.Tensor:
    """Quantize each row to float8 e4m3 with scale max|row| / 448, then dequantize (fp32)."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def hf_on_dequantized_weights(path):
    """HF's model of ``path`` with each decoder linear layer's weight replaced by its
    per-channel float8 round trip and its input fake-quantized per token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS:
            with torch.no_grad():
                module.weight.copy_(fake_quant_rows(module.weight))
            module.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]).to(args[0].dtype),))
            hooked += 1
    assert hooked == 7 * model.config.num_hidden_layers
    return model


def hf_greedy(model, prompts):
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            new = gen.sequences[0, len(p):]
            tokens.append(new.tolist())
            steps = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), dim=-1)  # (steps, V)
            logprobs.append(steps.gather(1, new[:, None])[:, 0].tolist())
    return tokens, logprobs


def hf_scores(model, prompt, tokens) -> torch.Tensor:
    """HF's log-probabilities (len(tokens), V) at each position of ``tokens`` after ``prompt``,
    teacher-forced (so one early near-tie does not make the rest incomparable)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (len(tokens), V)
    return torch.log_softmax(logits, dim=-1)


def engine_greedy(path, prompts, **kw):
    with LLM(str(path), device="cpu", swap_space=0, **kw) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


# ----- layers ---------------------------------------------------------------------------------
def _filled(layer, shards):
    """Load full-precision checkpoint tensors into ``layer``; returns the full weight."""
    for shard_id, tensor in shards:
        layer.weight_loader(layer.weight, tensor, shard_id)
    return torch.cat([t for _, t in shards], dim=0)


@pytest.mark.parametrize("kind", ["qkv", "merged", "row"])
def test_fp8_linear_equals_the_emulation_reference(kind):
    torch.manual_seed(0)
    if kind == "qkv":
        layer = QKVParallelLinear(64, 16, 4, 2, quantization="fp8")
        full = _filled(layer, [("q", torch.randn(64, 64)), ("k", torch.randn(32, 64) * 3), ("v", torch.randn(32, 64))])
    elif kind == "merged":
        layer = MergedColumnParallelLinear(64, [96, 96], quantization="fp8")
        full = _filled(layer, [(0, torch.randn(96, 64)), (1, torch.randn(96, 64) * 0.01)])
    else:
        layer = RowParallelLinear(96, 64, quantization="fp8")
        full = torch.randn(64, 96)
        layer.weight_loader(layer.weight, full)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    # per output channel: each row's largest element lands on 448
    torch.testing.assert_close(layer.weight_scale, full.abs().amax(dim=1) / 448.0, rtol=0, atol=0)
    x = torch.randn(5, full.shape[1]) * torch.tensor([0.01, 1.0, 30.0, 1.0, 2.0])[:, None]
    expected = fake_quant_rows(x) @ fake_quant_rows(full).t()
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    # and it is a real quantization: off the unquantized product by float8's rounding
    rel = (layer(x) - x @ full.t()).norm() / (x @ full.t()).norm()
    assert 1e-3 < rel < 0.1


def test_row_parallel_keeps_whole_row_scales():
    """A row-parallel shard of rank 1 of 2 cuts the input dim and keeps every channel's scale,
    taken over the whole row (both ranks hold the same scales)."""
    import engine.layers.linear as linear

    torch.manual_seed(1)
    full = torch.randn(32, 64)
    full[:, :32] *= 10  # the rows' largest elements all sit in rank 0's half
    original = linear.tp_rank, linear.tp_size
    linear.tp_rank, linear.tp_size = (lambda: 1), (lambda: 2)
    try:
        layer = RowParallelLinear(64, 32, quantization="fp8")
    finally:
        linear.tp_rank, linear.tp_size = original
    layer.weight_loader(layer.weight, full)
    torch.testing.assert_close(layer.weight_scale, full.abs().amax(dim=1) / 448.0, rtol=0, atol=0)
    deq = layer.weight.float() * layer.weight_scale[:, None]
    torch.testing.assert_close(deq, fake_quant_rows(full)[:, 32:], rtol=0, atol=0)


# ----- the whole engine against HF ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_hf_on_dequantized_weights(tiny_model_factory, arch):
    """Chunked prefill, shared prefixes and a float32 checkpoint quantized at load."""
    path = tiny_model_factory(arch, seed=3)
    prompts = make_prompts(384, n=6, seed=2)
    tokens, logprobs = engine_greedy(path, prompts, quantization="fp8", block_size=8, max_num_batched_tokens=32,
                                    max_num_seqs=8)
    expected_tokens, expected_logprobs = hf_greedy(hf_on_dequantized_weights(path), prompts)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs):
        assert got == pytest.approx(expected, abs=1e-4)
    # the unquantized engine gives other tokens on these weights, so the match above is fp8's
    assert engine_greedy(path, prompts)[0] != tokens


def assert_small_batch_greedy_is_hfs(path) -> None:
    """The FP8 engine's greedy tokens on ``path`` (decode steps of up to 4 sequences, where the
    float8 split-K kernel runs) are HF's on the dequantized weights, logprobs within 1e-3."""
    prompts = make_prompts(384, n=4, seed=2)
    tokens, logprobs = engine_greedy(path, prompts, quantization="fp8", block_size=8, max_num_seqs=4)
    expected_tokens, expected_logprobs = hf_greedy(hf_on_dequantized_weights(path), prompts)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs):
        assert got == pytest.approx(expected, abs=1e-3)


@pytest.mark.skipif(not interpreting(), reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
def test_greedy_matches_hf_with_the_norms_in_the_float8_kernel(tiny_model_factory, monkeypatch):
    """FP8_SMALL_M_FOLDS: at decode steps o and down are the float8 split-K kernel with the norm
    after each (and its quantization for the next product) in their launch; HF's tokens still."""
    import engine.layers.fp8 as fp8
    import engine.layers.linear as linear_layers
    import engine.models.llama as llama

    folded = []
    real = fp8.fp8_small_m_matmul

    def counted(*args, norm_after=None, quantize=False, **kwargs):
        folded.append((norm_after is not None, quantize))
        return real(*args, norm_after=norm_after, quantize=quantize, **kwargs)

    monkeypatch.setattr(llama, "FP8_SMALL_M_FOLDS", True)
    monkeypatch.setattr(llama, "FP8_SMALL_M_PROJECTIONS", ())  # the folds' o and down alone take the kernel
    monkeypatch.setattr(linear_layers, "SMALL_M_INTERPRETED", True)
    monkeypatch.setattr(fp8, "fp8_small_m_matmul", counted)
    path = tiny_model_factory("llama", seed=3)
    assert_small_batch_greedy_is_hfs(path)
    # o quantizes for gate/up; down for the next layer's q/k/v, the last layer's for the final norm: not
    assert set(folded) == {(True, True), (True, False)}


@pytest.mark.skipif(not interpreting(), reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("projections", [("qkv_proj",), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")])
def test_greedy_matches_hf_with_chosen_projections_in_the_float8_kernel(tiny_model_factory, monkeypatch, projections):
    """FP8_SMALL_M_PROJECTIONS: at decode steps the chosen projections (and they alone) are the
    float8 split-K kernel with both scales in its launch; HF's tokens still."""
    import engine.layers.fp8 as fp8
    import engine.layers.linear as linear_layers
    import engine.models.llama as llama

    widths = []  # the output width of every product the kernel took
    real = fp8.fp8_small_m_matmul

    def counted(q, x_scale, weight, *args, **kwargs):
        widths.append(weight.shape[0])
        return real(q, x_scale, weight, *args, **kwargs)

    monkeypatch.setattr(llama, "FP8_SMALL_M_PROJECTIONS", projections)
    monkeypatch.setattr(linear_layers, "SMALL_M_INTERPRETED", True)
    monkeypatch.setattr(fp8, "fp8_small_m_matmul", counted)
    path = tiny_model_factory("llama", seed=3)
    assert_small_batch_greedy_is_hfs(path)
    config = json.loads((path / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    width = {"qkv_proj": (heads + 2 * kv_heads) * hidden // heads, "o_proj": hidden,
             "gate_up_proj": 2 * config["intermediate_size"], "down_proj": hidden}
    assert set(widths) == {width[name] for name in projections}


def test_the_small_m_routing_reads_every_kind_of_input(monkeypatch):
    """takes_small_m sees a float tensor, an ``Fp8Input`` and an ``UnscaledProduct`` (a deferred
    product reaching the next layer's check on a GPU): each by its rows."""
    import engine.layers.linear as linear_layers
    from engine.layers.fp8 import Fp8Input, UnscaledProduct

    monkeypatch.setattr(linear_layers, "SMALL_M_INTERPRETED", True)
    layer = RowParallelLinear(64, 32, quantization="fp8")
    layer.small_m_rows = 8
    for rows, takes in ((8, interpreting()), (9, False)):
        x = torch.zeros(rows, 64)
        unscaled = UnscaledProduct(x, torch.ones(rows, 1), torch.ones(64), None, torch.float32)
        fp8_input = Fp8Input(x.to(torch.float8_e4m3fn), torch.ones(rows, 1), torch.float32)
        assert [layer.takes_small_m(v) for v in (x, fp8_input, unscaled)] == [takes] * 3


def test_dummy_weights_are_quantized_per_channel():
    from transformers import LlamaConfig

    from engine.models.loader import load_model

    config = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=384, max_position_embeddings=128)
    model, _ = load_model(config, load_format="dummy", device="cpu", quantization="fp8")
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.weight.dtype == torch.float8_e4m3fn
            assert torch.all(linear.weight.float().abs().amax(dim=1) == 448.0)  # each row's largest on 448
            assert torch.all((0.02 < linear.weight_scale * 448) & (linear.weight_scale * 448 < 0.2))  # amax of N(0, 0.02)
    assert model.lm_head.weight.dtype == torch.float32  # the head stays in the model's dtype


def test_tp2_equals_tp1(tiny_model_factory):
    """Two gloo ranks: q/k/v and gate/up shards carry their rows' scales, o/down shards the
    whole rows' scales; the greedy tokens are those of one rank."""
    path = tiny_model_factory("llama", seed=3)
    prompts = make_prompts(384, n=6, seed=4)
    expected = engine_greedy(path, prompts, quantization="fp8", block_size=8)[0]
    assert engine_greedy(path, prompts, quantization="fp8", block_size=8, tensor_parallel_size=2)[0] == expected


# ----- validation and accounting ------------------------------------------------------------------
def test_unknown_quantization_names_the_field(tiny_model_factory):
    with pytest.raises(ValueError, match="quantization must be one of fp8; got 'int4'"):
        EngineArgs("m", quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of fp8; got 'awq'"):
        LLM(str(tiny_model_factory("llama", seed=3)), device="cpu", quantization="awq")


def test_roofline_counts_one_byte_weights():
    from engine.models.presets import preset_config

    config = preset_config("llama3-8b")
    bf16 = ModelCounts.from_config(config, dtype_bytes=2)
    fp8 = ModelCounts.from_config(config, dtype_bytes=2, linear_dtype_bytes=1)
    # the decoder's matmul weights at one byte, the LM head and norms at two
    assert bf16.weight_bytes - fp8.weight_bytes == bf16.linear_params
    assert fp8.weight_bytes == bf16.linear_params + 2 * (bf16.lm_head_params + (2 * 32 + 1) * 4096)


def test_worker_passes_quantization_through():
    from worker.settings import WorkerSettings

    assert WorkerSettings(model="m", quantization="fp8").engine_kwargs()["quantization"] == "fp8"
    assert "quantization" not in WorkerSettings(model="m").engine_kwargs()  # unset: the checkpoint's own
