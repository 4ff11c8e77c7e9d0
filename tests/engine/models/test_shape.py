"""``ModelShape``: one set of sizes, read from the HF config, that agrees with the model and cache built from it."""

from __future__ import annotations

import pytest
import torch

from engine.models.presets import preset_config
from engine.models.shape import ModelShape


def test_llama3_8b_sizes_whole_and_per_rank():
    config = preset_config("llama3-8b")
    shape = ModelShape.from_hf_config(config)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (32, 32, 8, 128)
    assert shape.kv_bytes_per_token(2) == 128 * 1024  # K and V, 8 heads x 128, 32 layers, bf16
    assert shape.linear_params + shape.lm_head_params == 7_504_658_432  # 8.03B less the embedding and norms
    at16 = ModelShape.from_hf_config(config, tensor_parallel_size=16)
    assert at16.num_kv_heads_per_rank == 1 and at16.num_cached_kv_heads == 16  # 8 heads, each on two ranks
    assert at16.total_kv_bytes_per_token(2) == 2 * shape.kv_bytes_per_token(2)
    assert ModelShape.from_hf_config(config, 2).kv_bytes_per_token(1) == shape.kv_bytes_per_token(1) // 2


@pytest.mark.parametrize("arch, tp", [("llama", 1), ("qwen3", 1), ("llama", 2)])
def test_parameter_counts_are_those_of_the_built_model(tiny_model_factory, arch, tp):
    """What the cost model and the roofline multiply through is what the model holds."""
    from engine.models.loader import load_model

    model, config = load_model(str(tiny_model_factory(arch)), device="cpu")
    shape = ModelShape.from_hf_config(config, tp)
    matmuls = sum(p.numel() for name, p in model.named_parameters()
                  if name.endswith("proj.weight") or name == "lm_head.weight")
    assert shape.linear_params + shape.lm_head_params == matmuls
    assert shape.matmul_params_per_rank == matmuls // tp
    norms = sum(p.numel() for name, p in model.named_parameters() if name.endswith("norm.weight"))
    extra = norms - (2 * config.num_hidden_layers + 1) * config.hidden_size  # Qwen3's per-head q/k norms
    assert shape.weight_bytes(4) == (matmuls + norms - extra) * 4


def test_the_cache_engine_holds_what_the_shape_says(tiny_model_factory):
    from engine.models.loader import load_hf_config
    from engine.runner.cache_engine import CacheEngine

    shape = ModelShape.from_hf_config(load_hf_config(str(tiny_model_factory("llama"))))
    cache = CacheEngine(shape, block_size=4, num_gpu_blocks=3, cpu_chunk_blocks=2, dtype=torch.float32,
                        device=torch.device("cpu"))
    assert cache.bytes_per_block == shape.kv_bytes_per_token(4) * 4
    assert cache.gpu.numel() * 4 == 3 * cache.bytes_per_block
    assert cache.kv_caches[0][0].shape == (3, 4, shape.num_kv_heads_per_rank, shape.head_dim)


@pytest.mark.parametrize("tp", [1, 2, 16])
def test_it_carries_every_count_of_the_roofline(tp):
    """The roofline's counts, each one ModelShape expression (its switch after the move)."""
    from bench.roofline import ModelCounts

    config = preset_config("llama3-8b")
    shape = ModelShape.from_hf_config(config, tp)
    counts = ModelCounts.from_config(config, dtype_bytes=2, kv_dtype_bytes=1, tensor_parallel_size=tp)
    assert counts.linear_params == shape.linear_params
    assert counts.lm_head_params == shape.lm_head_params
    assert counts.weight_bytes == shape.weight_bytes(2)
    assert counts.kv_bytes_per_token == shape.total_kv_bytes_per_token(1)
    assert counts.attn_flops_per_key == shape.attn_flops_per_key
