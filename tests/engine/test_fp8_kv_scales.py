"""FP8 checkpoints that carry per-layer K/V cache scales, on a float8 KV cache (CPU).

The tiny llama is written in the plain ``fp8`` format (as test_fp8_checkpoints does) plus
``self_attn.k_scale`` / ``v_scale`` per layer. With ``kv_cache_dtype="fp8"`` the engine's
greedy tokens must equal HF's on the same dequantized weights with each key and value
quantized with its layer's scales; scales of 1 must give today's outputs exactly.
"""

import json
import logging
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine import LLM
from tests.engine.test_fp8 import GREEDY, LINEARS, engine_greedy, fake_quant_rows, hf_greedy
from tests.engine.test_fp8_checkpoints import write_quantized
from tests.engine.test_generate import make_prompts

# near max|K| / 448 and max|V| / 448 of the tiny llama (about 4.6 and 4.2), not powers of two
SCALES = {0: (0.0113, 0.0093), 1: (0.0107, 0.0101)}
_HF_SCALES: dict[int, tuple[float, float]] = {}  # the layer scales HF's attention quantizes with


def _quantized(t: torch.Tensor, scale: float) -> torch.Tensor:
    top = torch.finfo(torch.float8_e4m3fn).max
    return ((t.float() / scale).clamp(-top, top).to(torch.float8_e4m3fn).float() * scale).to(t.dtype)


def _scaled_fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    k_scale, v_scale = _HF_SCALES[module.layer_idx]
    return sdpa_attention_forward(module, query, _quantized(key, k_scale), _quantized(value, v_scale),
                                  attention_mask, **kwargs)


AttentionInterface.register("scaled_fp8_kv_sdpa", _scaled_fp8_kv_sdpa)


def with_kv_scales(path, scales: dict[int, tuple[float, float]], names=("k_scale", "v_scale"), shape=()):
    """Add one K and one V scale per layer to the checkpoint in ``path``, under ``names``
    (``("kv_scale",)``: one for both, the K one)."""
    tensors = load_file(str(path / "model.safetensors"))
    for layer, (k_scale, v_scale) in scales.items():
        for name, value in zip(names, (k_scale, v_scale)):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.full(shape, value, dtype=torch.float32)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def fp8_model(tiny_model_factory, tmp_path_factory):
    """(the full-precision source, the fp8 checkpoint without K/V scales, its dequantized weights)."""
    src = tiny_model_factory("llama", seed=3)
    dst = tmp_path_factory.mktemp("fp8") / "model"
    return src, dst, write_quantized(src, dst, "fp8")


def copy_of(fp8_model, tmp_path, scales=None, **kw):
    path = shutil.copytree(fp8_model[1], tmp_path / "model")
    return with_kv_scales(path, scales, **kw) if scales else path


def hf_scaled(src, dequantized, scales):
    """HF on the dequantized weights (activations fake-quantized per token, as the engine's
    W8A8 runs them) with keys and values quantized to float8 with each layer's scales."""
    _HF_SCALES.clear()
    _HF_SCALES.update(scales)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                              attn_implementation="scaled_fp8_kv_sdpa")
    model.generation_config.eos_token_id = None
    for name, module in model.named_modules():
        if name in dequantized:
            assert name.split(".")[-1] in LINEARS
            with torch.no_grad():
                module.weight.copy_(dequantized[name])
            module.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]).to(args[0].dtype),))
    return model


FP8_KV = dict(kv_cache_dtype="fp8", block_size=8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_scales_match_hf_with_keys_and_values_quantized_by_them(fp8_model, tmp_path, backend):
    path = copy_of(fp8_model, tmp_path, SCALES)
    prompts = make_prompts(384, n=4 if backend == "triton" else 6, seed=3)
    tokens, logprobs = engine_greedy(path, prompts, attention_backend=backend, **FP8_KV)
    expected_tokens, expected_logprobs = hf_greedy(hf_scaled(fp8_model[0], fp8_model[2], SCALES), prompts)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs):
        assert got == pytest.approx(expected, abs=1e-4)
    # and the scales matter: quantized with a scale of 1 (more keys and values subnormal), the
    # logprobs move by 0.4-1.6 on these prompts
    _, unit_logprobs = hf_greedy(hf_scaled(fp8_model[0], fp8_model[2], {0: (1.0, 1.0), 1: (1.0, 1.0)}), prompts)
    assert min(max(abs(a - b) for a, b in zip(got, unit)) for got, unit in zip(logprobs, unit_logprobs)) > 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graphs_read_the_scales(fp8_model, tmp_path):
    """The scales are device tensors the captured decode graphs read (HF runs on the CPU).

    NOTE: HF scores the engine's own tokens, teacher-forced (``check_against_hf``), with the
    GPU tolerances of the fp32 FP8 engine test: a GPU sum a hair off the CPU's rounds an
    activation or a key to the next float8 value, which moved logprobs by up to 0.19 there and
    parted the greedy sequences from HF's in two H200 runs of this test. Scales of 1 move HF's
    logprobs of the same tokens by more than twice that tolerance, so ignored scales fail."""
    from tests.engine.test_fp8 import hf_scores
    from tests.engine.test_fp8_gpu import check_against_hf

    path = copy_of(fp8_model, tmp_path, SCALES)
    prompts = make_prompts(384, n=6, seed=3)
    with LLM(str(path), device="cuda", dtype="float32", swap_space=0, gpu_memory_utilization=0.3, **FP8_KV) as llm:
        assert llm.llm_engine.executor.runner.graphs is not None
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    hf = hf_scaled(fp8_model[0], fp8_model[2], SCALES)
    check_against_hf(outs, prompts, hf, margin=0.3, tol=0.3)
    scaled = [hf_scores(hf, p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    hf = hf_scaled(fp8_model[0], fp8_model[2], {0: (1.0, 1.0), 1: (1.0, 1.0)})  # NOTE: scales are read at forward time
    unit = [hf_scores(hf, p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    moved = max((u - s).abs().max().item() for u, s in zip(unit, scaled))
    assert moved > 0.6, f"scales of 1 move HF's logprobs by only {moved:.3f}: the check above could not tell"

def test_scales_of_one_give_todays_outputs_exactly(fp8_model, tmp_path):
    prompts = make_prompts(384, n=4, seed=5)
    today = engine_greedy(fp8_model[1], prompts, **FP8_KV)
    ones = copy_of(fp8_model, tmp_path, {0: (1.0, 1.0), 1: (1.0, 1.0)}, shape=(1,))
    with LLM(str(ones), device="cpu", swap_space=0, **FP8_KV) as llm:
        attn = llm.llm_engine.executor.runner.model.model.layers[1].self_attn.attn
        assert attn.kv_scaled and attn.k_scale.tolist() == [1.0]  # read, and handed to the kernels
    assert engine_greedy(ones, prompts, **FP8_KV) == today


@pytest.mark.parametrize("names,expected", [
    (("kv_scale",), (0.0113, 0.0113)),  # the older single scale: both K and V
    (("k_proj.output_scale", "v_proj.output_scale"), (0.0113, 0.0093)),  # older compressed-tensors exports
    (("k_proj.k_scale", "v_proj.v_scale"), (0.0113, 0.0093)),  # ModelOpt's
])
def test_other_scale_names_load(fp8_model, tmp_path, names, expected):
    path = copy_of(fp8_model, tmp_path, SCALES, names=names)
    with LLM(str(path), device="cpu", swap_space=0, **FP8_KV) as llm:
        attn = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.attn
        assert attn.kv_scaled
        assert (attn.k_scale.item(), attn.v_scale.item()) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("value,shape,message", [
    (0.0, (), "is 0.0; a K/V cache scale must be finite and > 0"),
    (float("nan"), (1,), "is nan; a K/V cache scale must be finite and > 0"),
    (-0.5, (), "is -0.5; a K/V cache scale must be finite and > 0"),
    (0.01, (2,), r"has shape \(2,\); a K/V cache scale must be one value"),
])
def test_a_bad_scale_is_a_load_error_naming_the_tensor(fp8_model, tmp_path, value, shape, message):
    path = copy_of(fp8_model, tmp_path, {0: (0.01, 0.01), 1: (0.01, 0.01)})
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.full(shape, value, dtype=torch.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.1.self_attn.v_scale' " + message):
        LLM(str(path), device="cpu", swap_space=0, **FP8_KV)


def test_without_a_float8_cache_the_scales_are_ignored_with_one_log_line(fp8_model, tmp_path, caplog):
    path = copy_of(fp8_model, tmp_path, SCALES)
    with caplog.at_level(logging.INFO, logger="engine.layers.kv_scales"), \
            LLM(str(path), device="cpu", swap_space=0, block_size=8) as llm:
        attn = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.attn
        assert not attn.kv_scaled
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.layers.kv_scales"]
    assert len(lines) == 1 and "K/V cache scales for 2 attention layers; they are ignored" in lines[0]


def test_kv_cache_scheme_other_than_per_tensor_float8_names_the_field(fp8_model, tmp_path):
    path = copy_of(fp8_model, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False},
    }
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.kv_cache_scheme.strategy='attn_head' is not supported"):
        LLM(str(path), device="cpu", swap_space=0, **FP8_KV)


def test_tensor_parallel_ranks_each_keep_their_layers_scales(fp8_model, tmp_path):
    """Two gloo ranks, each with one of the two KV heads: the same tokens as one rank (which
    matches HF above; with scales of 1, two of these three prompts' tokens differ)."""
    path = copy_of(fp8_model, tmp_path, SCALES)
    prompts = make_prompts(384, n=3, seed=3)
    expected = engine_greedy(path, prompts, **FP8_KV)[0]
    assert engine_greedy(path, prompts, tensor_parallel_size=2, **FP8_KV)[0] == expected
