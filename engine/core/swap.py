"""Swap-pool geometry, and the cost model and rates behind ``preemption_mode="auto"``.

Plain Python over the ``EngineConfig``: rank 0's block manager and every rank's cache engine
call the same functions on the same config, so they agree on chunk boundaries without talking.
All sizes are per rank (per GPU), like ``swap_space``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.block_manager import BlockManager
    from engine.core.sequence import Sequence

SWAP_CHUNK_BYTES = 256 << 20

# NOTE: assumed, not measured at start-up (``bench.swap`` measures the copies).
# cuda: pinned copies over PCIe run at 25 GB/s (gen4) to 50 GB/s (gen5) per direction, so
# take the low end; a prefill sustains about 400 dense bf16 TFLOP/s on an H100/H200.
# cpu: a swap is a copy between two host tensors (about 5 GB/s) and a recompute runs the
# model's matmuls on a few cores (about 50 GFLOP/s in float32). Both only touch host memory,
# so the same comparison holds with these rates; swapping wins for every model we run there.
_RATES = {"cuda": (25e9, 400e12), "cpu": (5e9, 50e9)}  # (swap bytes/s, prefill FLOP/s)


@dataclass(frozen=True)
class PreemptionCostModel:
    """How ``preemption_mode="auto"`` chooses: the cheaper of swapping and recomputing a victim.

    swap: the blocks not already in the CPU pool cross the host link twice (out now, back in
    later), ``2 * blocks * block_bytes / swap_bytes_per_s`` seconds. recompute: the computed
    tokens not held on the GPU by another sequence are prefilled again,
    ``tokens / prefill_tokens_per_s`` seconds. Both are per rank: ranks copy and compute their
    shards in parallel. The engine sets the rates (``engine.core.swap.preemption_cost_model``).

    NOTE: prefill is taken as linear in tokens; attention makes it superlinear, so long
    sequences cost a little more to recompute than this says, which only favours swapping more.
    """

    block_bytes: int  # KV bytes of one block on one rank
    swap_bytes_per_s: float  # host <-> device, one direction
    prefill_tokens_per_s: float

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefer_swap(self, seq: Sequence, bm: BlockManager) -> bool:
        return self.swap_seconds(bm.num_swap_out_copies(seq)) <= self.recompute_seconds(bm.num_recompute_tokens(seq))


def swap_chunk_blocks(config: EngineConfig) -> int:
    """Blocks per swap-pool chunk: 256 MiB, or less for a pool under 1 GiB.

    A small pool (tests, CPU) gets chunks of a quarter of ``swap_space`` rounded down to a
    power of two, so it can still grow and shrink in steps.

    NOTE: chunk bytes are a power of two because torch's pinned-memory allocator rounds each
    allocation up to one: a chunk then wastes at most one block of pinned memory.
    """
    swap_bytes = config.cache.swap_bytes
    chunk_bytes = SWAP_CHUNK_BYTES
    if 0 < swap_bytes < 4 * SWAP_CHUNK_BYTES:
        chunk_bytes = 1 << max(0, (swap_bytes // 4).bit_length() - 1)
    return max(1, chunk_bytes // config.kv_bytes_per_block)


def swap_pool_blocks(num_bytes: int, config: EngineConfig) -> int:
    """Blocks of a pool of at most ``num_bytes``: whole chunks."""
    chunk = swap_chunk_blocks(config)
    blocks = max(0, num_bytes) // config.kv_bytes_per_block
    return blocks // chunk * chunk


def resize_swap_pool(pool: Any, executor: Any, config: EngineConfig, num_bytes: int) -> int:
    """Grow or shrink the CPU swap ``pool`` toward ``num_bytes`` per GPU; returns the bytes it now has.

    The pool moves in whole chunks (rounded down) and swapped-out sequences keep their blocks:
    growing appends chunks, whose host memory is taken on their first swap-out; shrinking drops
    chunks from the end while they are entirely free and releases their memory on every rank
    (``executor``), so it may stop above ``num_bytes`` until those blocks come back in.
    """
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a non-negative integer, got {num_bytes!r}")
    before = pool.num_blocks
    after = pool.resize(swap_pool_blocks(num_bytes, config))
    if after != before:
        executor.resize_swap_pool(after)
    return after * config.kv_bytes_per_block


def preemption_cost_model(config: EngineConfig) -> PreemptionCostModel:
    """The engine's cost model: assumed link and compute rates for this device and model."""
    swap_bytes_per_s, flops = _RATES["cuda" if config.model.device.type == "cuda" else "cpu"]
    prefill_tokens_per_s = flops / (2 * config.shape.matmul_params_per_rank)
    return PreemptionCostModel(config.kv_bytes_per_block, swap_bytes_per_s, prefill_tokens_per_s)
