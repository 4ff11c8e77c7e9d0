"""``EngineStats``: one snapshot of the engine's queues, cache and cumulative counters (``LLMEngine.get_stats``)."""

from __future__ import annotations

from dataclasses import dataclass


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
