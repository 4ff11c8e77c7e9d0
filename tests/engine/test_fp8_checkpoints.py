"""Pre-quantized FP8 checkpoints in the formats users download, written here from a tiny model:
compressed-tensors ``float-quantized`` (per channel and per tensor) and the plain ``fp8``
format (one ``weight_scale`` and a static ``input_scale`` per tensor).

The engine reads the checkpoint's float8 weights and scales as they are; its greedy tokens
must equal HF's on the same dequantized weights, with activations quantized per token.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from tests.engine.test_fp8 import LINEARS, engine_greedy, fake_quant_rows, hf_greedy
from tests.engine.test_generate import make_prompts

E4M3_MAX = 448.0


def quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 weight and its scale: (N, 1) per channel, or () per tensor."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = amax.float() / E4M3_MAX
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def write_quantized(src, dst, fmt: str):
    """Copy the checkpoint ``src`` to ``dst`` with its decoder linear layers in float8;
    returns {module name: dequantized weight}."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    dequantized = {}
    for name in list(tensors):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.split(".")[-1] not in LINEARS:
            continue
        q, scale = quantize(tensors[name], per_channel=fmt == "compressed-tensors-channel")
        tensors[name] = q
        tensors[module + ".weight_scale"] = scale.reshape(-1, 1) if fmt == "compressed-tensors-channel" else \
            scale.reshape(1) if fmt == "compressed-tensors-tensor" else scale.reshape(())
        if fmt == "fp8":  # a static activation scale, which the engine reads past
            tensors[module + ".input_scale"] = torch.tensor(0.05)
        dequantized[module] = q.float() * scale
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def quantization_config(fmt: str) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    strategy = "channel" if fmt.endswith("channel") else "tensor"
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
        "kv_cache_scheme": None,
    }


def hf_on(src, dequantized):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    for name, module in model.named_modules():
        if name in dequantized:
            with torch.no_grad():
                module.weight.copy_(dequantized[name])
            module.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]).to(args[0].dtype),))
    return model


@pytest.mark.parametrize("fmt", ["compressed-tensors-channel", "compressed-tensors-tensor", "fp8"])
def test_prequantized_checkpoint_matches_hf(tiny_model_factory, tmp_path, fmt):
    src = tiny_model_factory("llama", seed=3)
    dequantized = write_quantized(src, tmp_path / "model", fmt)
    prompts = make_prompts(384, n=5, seed=2)
    # the checkpoint says how it is quantized; asking for fp8 is the same
    tokens, logprobs = engine_greedy(tmp_path / "model", prompts)
    assert engine_greedy(tmp_path / "model", prompts, quantization="fp8")[0] == tokens
    expected_tokens, expected_logprobs = hf_greedy(hf_on(src, dequantized), prompts)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs):
        assert got == pytest.approx(expected, abs=1e-4)


def test_prequantized_weights_are_kept_not_requantized(tiny_model_factory, tmp_path):
    """Per-tensor scales: q, k and v keep their own scale inside the fused matrix's rows."""
    src = tiny_model_factory("llama", seed=3)
    dequantized = write_quantized(src, tmp_path / "model", "compressed-tensors-tensor")
    with LLM(str(tmp_path / "model"), device="cpu", swap_space=0) as llm:
        qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert llm.llm_engine.config.model.quantization == "fp8"
        deq = qkv.weight.float() * qkv.weight_scale[:, None]
        expected = torch.cat([dequantized[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])
        torch.testing.assert_close(deq, expected, rtol=0, atol=0)
        assert len(set(qkv.weight_scale.tolist())) == 3


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "awq"}, "quantization_config.quant_method 'awq' is not supported"),
    ({"weight_block_size": [128, 128]}, r"quantization_config.weight_block_size=\[128, 128\]: block-wise"),
    ({"ignored_layers": ["model.layers.0.mlp.down_proj"]}, "leaves 'model.layers.0.mlp.down_proj' unquantized"),
])
def test_unsupported_schemes_name_the_field(tiny_model_factory, tmp_path, change, message):
    src = tiny_model_factory("llama", seed=3)
    write_quantized(src, tmp_path / "model", "fp8")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "model"), device="cpu", swap_space=0)
