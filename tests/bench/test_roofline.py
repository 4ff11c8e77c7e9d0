"""The roofline's counts and bounds against numbers worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.roofline import DeviceCeilings, ModelCounts, generation_bound


def test_llama3_8b_counts():
    config = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, intermediate_size=14336, vocab_size=128256)
    counts = ModelCounts.from_config(config)
    per_layer = 4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336  # q, k, v; o; gate, up, down
    assert counts.linear_params == 32 * per_layer == 6_979_321_856
    assert counts.lm_head_params == 128256 * 4096
    assert counts.kv_bytes_per_token == 128 * 1024  # 128 KiB: K and V, 8 heads x 128, 32 layers, bf16
    assert counts.attn_flops_per_key == 4 * 32 * 32 * 128
    assert counts.weight_bytes == 2 * (32 * per_layer + 128256 * 4096 + 65 * 4096)


def test_bounds_of_one_request_charge_compute_and_memory_as_the_formula_says():
    # 1 FLOP/s and 1 B/s, so every time below is a raw count
    ceilings = DeviceCeilings(matmul_tflops=1e-12, bandwidth_gbs=1e-9)
    counts = ModelCounts(linear_params=50, lm_head_params=0, weight_bytes=20, kv_bytes_per_token=10,
                         attn_flops_per_key=1)
    bound = generation_bound(counts, ceilings, input_lens=[2], output_lens=[2], max_batch=1, max_step_tokens=4)
    # prefill, one step: FLOPs 2*50*2 + causal keys 1+2 = 203, bytes 20 weights + 2*10 K/V = 40
    # decode, one step (the first token came from the prefill): 3 keys, FLOPs 100 + 3 = 103,
    # bytes 20 + (3 + 1) * 10 = 60
    assert bound["prefill_bound_s"] == pytest.approx(203)
    assert bound["decode_bound_s"] == pytest.approx(103)
    assert bound["bound_s"] == pytest.approx(306)
    assert bound["decode_steps"] == 1
    assert bound["strict_bound_s"] == pytest.approx(max(306, 100))
    # one kernel after another: prefill max(200, 20) + max(3, 20), decode max(100, 20) + max(3, 40)
    assert bound["serial_bound_s"] == pytest.approx(220 + 140)


def test_waves_of_the_batch_cap_decode_steps():
    ceilings = DeviceCeilings(matmul_tflops=1e-12, bandwidth_gbs=1e-9)
    counts = ModelCounts(linear_params=1, lm_head_params=1, weight_bytes=1000, kv_bytes_per_token=1,
                         attn_flops_per_key=1)
    wide = generation_bound(counts, ceilings, [4] * 4, [5] * 4, max_batch=4, max_step_tokens=16)
    narrow = generation_bound(counts, ceilings, [4] * 4, [5] * 4, max_batch=2, max_step_tokens=16)
    assert wide["decode_steps"] == 4 and narrow["decode_steps"] == 8
    # memory-bound steps that each read the weights: twice the steps, about twice the time
    assert narrow["decode_bound_s"] > 1.9 * wide["decode_bound_s"]
    assert wide["serial_bound_s"] >= wide["bound_s"] >= wide["strict_bound_s"]


def test_tensor_parallel_bound_splits_the_work_over_the_gpus_and_counts_replicated_kv_heads():
    config = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=100)
    assert ModelCounts.from_config(config, tensor_parallel_size=2) == ModelCounts.from_config(config)
    # four ranks over two KV heads: each rank caches a copy of one, four heads' bytes in all
    replicated = ModelCounts.from_config(config, tensor_parallel_size=4)
    assert replicated.kv_bytes_per_token == 2 * ModelCounts.from_config(config).kv_bytes_per_token
    assert replicated.linear_params == ModelCounts.from_config(config).linear_params

    one = DeviceCeilings(matmul_tflops=700.0, bandwidth_gbs=4000.0)
    assert one.over(2) == DeviceCeilings(matmul_tflops=1400.0, bandwidth_gbs=8000.0)
    counts = ModelCounts.from_config(config)
    alone = generation_bound(counts, one, [32] * 8, [16] * 8, max_batch=8, max_step_tokens=64)
    pair = generation_bound(counts, one.over(2), [32] * 8, [16] * 8, max_batch=8, max_step_tokens=64)
    for key in ("bound_s", "strict_bound_s", "serial_bound_s"):
        assert pair[key] == pytest.approx(alone[key] / 2)
