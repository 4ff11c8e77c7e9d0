"""Swap-pool geometry and the rates behind ``preemption_mode="auto"``.

Plain Python over ``ModelInfo``: rank 0's block manager and every rank's cache engine call
the same functions on the same info, so they agree on chunk boundaries without talking.
All sizes are per rank (per GPU), like ``swap_space``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler import PreemptionCostModel

if TYPE_CHECKING:
    from engine.model_info import ModelInfo

SWAP_CHUNK_BYTES = 256 << 20

# NOTE: assumed, not measured at start-up (``bench.swap`` measures the copies).
# cuda: pinned copies over PCIe run at 25 GB/s (gen4) to 50 GB/s (gen5) per direction, so
# take the low end; a prefill sustains about 400 dense bf16 TFLOP/s on an H100/H200.
# cpu: a swap is a copy between two host tensors (about 5 GB/s) and a recompute runs the
# model's matmuls on a few cores (about 50 GFLOP/s in float32). Both only touch host memory,
# so the same comparison holds with these rates; swapping wins for every model we run there.
_RATES = {"cuda": (25e9, 400e12), "cpu": (5e9, 50e9)}  # (swap bytes/s, prefill FLOP/s)


def swap_chunk_blocks(info: ModelInfo) -> int:
    """Blocks per swap-pool chunk: 256 MiB, or less for a pool under 1 GiB.

    A small pool (tests, CPU) gets chunks of a quarter of ``swap_space`` rounded down to a
    power of two, so it can still grow and shrink in steps.

    NOTE: chunk bytes are a power of two because torch's pinned-memory allocator rounds each
    allocation up to one: a chunk then wastes at most one block of pinned memory.
    """
    chunk_bytes = SWAP_CHUNK_BYTES
    if 0 < info.swap_bytes < 4 * SWAP_CHUNK_BYTES:
        chunk_bytes = 1 << max(0, (info.swap_bytes // 4).bit_length() - 1)
    blocks = max(1, chunk_bytes // info.bytes_per_block)
    if info.max_cpu_blocks is not None:
        blocks = max(1, min(blocks, info.max_cpu_blocks))
    return blocks


def swap_pool_blocks(num_bytes: int, info: ModelInfo) -> int:
    """Blocks of a pool of at most ``num_bytes``: whole chunks, within ``max_cpu_blocks_override``."""
    chunk = swap_chunk_blocks(info)
    blocks = max(0, num_bytes) // info.bytes_per_block
    if info.max_cpu_blocks is not None:
        blocks = min(blocks, info.max_cpu_blocks)
    return blocks // chunk * chunk


def params_per_rank(hf_config, tensor_parallel_size: int) -> int:
    """Weights one token's forward multiplies through on one rank (embedding lookup excluded)."""
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * h * hf_config.intermediate_size  # gate, up, down
    total = hf_config.num_hidden_layers * (attention + mlp) + hf_config.vocab_size * h
    return max(1, total // tensor_parallel_size)


def preemption_cost_model(info: ModelInfo) -> PreemptionCostModel:
    """The engine's cost model: assumed link and compute rates for this device and model."""
    swap_bytes_per_s, flops = _RATES["cuda" if info.device.type == "cuda" else "cpu"]
    prefill_tokens_per_s = flops / (2 * params_per_rank(info.hf_config, info.tensor_parallel_size))
    return PreemptionCostModel(info.bytes_per_block, swap_bytes_per_s, prefill_tokens_per_s)
