"""``ModelShape``: a model's sizes, read once from its HF config, whole and per tensor-parallel rank.

Plain Python (no torch): swap sizing, the preemption cost model, the cache engine, the models
and the roofline all read their sizes from here, so each quantity is worked out in one place.
Sizes are for the Llama family (Llama, Mistral, Qwen2, Qwen3): GQA attention, a SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int  # query heads, whole model
    num_kv_heads: int  # key/value heads, whole model
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tensor_parallel_size: int = 1

    @classmethod
    def from_hf_config(cls, config: Any, tensor_parallel_size: int = 1) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tensor_parallel_size=tensor_parallel_size,
        )

    # ----- per rank -----------------------------------------------------------------------
    @property
    def num_kv_heads_per_rank(self) -> int:
        """With fewer KV heads than ranks each rank holds one, a copy shared with other ranks."""
        return max(1, self.num_kv_heads // self.tensor_parallel_size)

    @property
    def num_cached_kv_heads(self) -> int:
        """KV heads the caches of all ranks hold together, replicas counted: ``max(kv heads, ranks)``."""
        return self.num_kv_heads_per_rank * self.tensor_parallel_size

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V bytes one token takes on one rank, all layers; ``itemsize``: the cache dtype's bytes."""
        return 2 * self.num_layers * self.num_kv_heads_per_rank * self.head_dim * itemsize

    def total_kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V bytes one token takes over all ranks (replicated KV heads counted on every rank)."""
        return self.kv_bytes_per_token(itemsize) * self.tensor_parallel_size

    # ----- parameters and FLOPs (whole model) -----------------------------------------------
    @property
    def linear_params(self) -> int:
        """Parameters of every layer's matmuls: q, k, v, o, gate, up, down."""
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        return self.num_layers * (attention + 3 * h * self.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def weight_bytes(self, itemsize: int, linear_itemsize: int | None = None) -> int:
        """Bytes of every weight one forward reads (embedding rows excluded; norms included);
        ``linear_itemsize``: the decoder matmuls' bytes per weight when they differ (1 for FP8)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        linear = self.linear_params * (linear_itemsize or itemsize)
        return linear + (self.lm_head_params + norms) * itemsize

    @property
    def attn_flops_per_key(self) -> int:
        """QK^T and PV FLOPs of one query token against one cached key, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    @property
    def matmul_params_per_rank(self) -> int:
        """Weights one token's forward multiplies through on one rank (embedding lookup excluded)."""
        return max(1, (self.linear_params + self.lm_head_params) // self.tensor_parallel_size)
