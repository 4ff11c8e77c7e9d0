"""Built-in configs of real architectures, for benchmarks on dummy weights.

Values are those of the published HF ``config.json`` files (the ``llama3-*`` presets are
Llama 3.1: 128K context with llama3 RoPE scaling). No tokenizer ships with a preset: a
preset model takes token ids in and gives token ids out.
"""

from __future__ import annotations

from typing import Any

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA31 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5, hidden_act="silu",
    num_key_value_heads=8, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
)

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32),
    "llama3-70b": dict(_LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64),
    "llama3.1-405b": dict(_LLAMA31, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                          num_attention_heads=128),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
        bos_token_id=151643, eos_token_id=151643, dtype="bfloat16",
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=28, bos_token_id=151643, eos_token_id=151645,
        dtype="bfloat16",
    ),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, **overrides: Any):
    """The preset's ``transformers`` config; ``overrides`` replace fields (e.g. fewer layers)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    values = dict(PRESETS[name], **overrides)
    return AutoConfig.for_model(values.pop("model_type"), **values)
