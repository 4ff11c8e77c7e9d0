"""Qwen2 / Qwen2.5: the Llama layout with a bias on the q, k and v projections."""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: Any) -> dict[str, bool]:
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)
