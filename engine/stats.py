"""``EngineStats``: one snapshot of the engine's queues, cache and cumulative counters (``LLMEngine.get_stats``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    swap_pool_bytes: int  # swap pool capacity, all ranks together
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    swap_out_bytes: int
    swap_in_bytes: int
    num_prompt_tokens: int  # cumulative: prompt tokens computed
    num_generation_tokens: int  # cumulative: tokens sampled
    swap_pool_resident_bytes: int = 0  # host memory the swap pool holds now (chunks touched), all ranks
    num_swap_outs: int = 0  # cumulative: sequences swapped out
    num_swap_ins: int = 0  # cumulative: sequences swapped back in
    num_recomputes: int = 0  # cumulative: sequences preempted by recompute (includes a full swap pool)
    num_rank_preemptions: int = 0  # cumulative: preemptions that seated a higher-rank sequence
    num_express: int = 0  # cumulative: prompts run in the express lane beside the step in flight
    prefix_cache_hit_tokens: int = 0  # cumulative: prompt tokens found in the prefix cache (not computed)

    @classmethod
    def collect(cls, scheduler: Any, block_manager: Any, bytes_per_block: int, num_prompt_tokens: int,
                num_generation_tokens: int) -> "EngineStats":
        """A snapshot of a scheduler and its block manager; ``bytes_per_block``: KV bytes of one
        block over all ranks."""
        s, bm = scheduler, block_manager
        return cls(
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            num_gpu_blocks=bm.gpu.num_blocks, num_free_gpu_blocks=bm.gpu.num_free,
            num_cpu_blocks=bm.cpu.num_blocks, num_free_cpu_blocks=bm.cpu.num_free,
            swap_pool_bytes=bm.cpu.num_blocks * bytes_per_block,
            prefix_cache_hit_rate=bm.prefix_stats.hit_rate, prefix_cache_hit_tokens=bm.prefix_stats.hit_tokens,
            swap_out_bytes=s.stats.num_swapped_out_blocks * bytes_per_block,
            swap_in_bytes=s.stats.num_swapped_in_blocks * bytes_per_block,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            swap_pool_resident_bytes=bm.cpu.num_used_chunks * bm.cpu.chunk_blocks * bytes_per_block,
            **dataclasses.asdict(s.stats),  # preemptions, swaps and recomputes, as the scheduler counts them
        )
