"""Qwen3: the Llama layout with an RMSNorm over each head of q and k (before RoPE) and an
explicit ``head_dim`` that need not equal hidden_size / num_heads."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
