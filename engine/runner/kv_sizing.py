"""How many KV blocks fit on a rank's device: the allocator's peak over a forward at the
largest step, the decode graphs' trial capture, and what is used outside the allocator."""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from engine.runner.attention.metadata import AttentionMetadata, ForwardContext
from engine.runner.cache_engine import CacheEngine
from engine.runner.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30  # KV cache on CPU devices when no block count is given
GIB = 1 << 30


def num_gpu_blocks(runner: "ModelRunner") -> int:
    """KV blocks that fit: ``(gpu_memory_utilization * total - in use - peak - graphs) / bytes per block``.

    ``peak`` is what this process's allocator held at the peak of a forward at the
    largest step (weights, activations, the sampled rows' logits and the sampler's
    largest temporaries); ``in use`` is device memory outside the allocator (CUDA
    context, libraries, other processes); ``graphs`` is the decode graphs' memory,
    measured by a trial capture. The whole device then stays under the fraction.
    """
    config = runner.config
    utilization, block_bytes = config.cache.gpu_memory_utilization, config.kv_bytes_per_block
    if runner.device.type != "cuda":
        want = runner.max_blocks_per_seq * config.scheduler.max_num_seqs
        return max(1, min(want, CPU_KV_BUDGET_BYTES // block_bytes))
    dev = runner.device
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    peak = profile_peak_bytes(runner)
    graph_bytes = estimate_graph_bytes(runner)
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    outside = max(0, (total - free) - torch.cuda.memory_reserved(dev))
    budget = utilization * total - outside - peak - graph_bytes
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {total / GIB:.1f} GiB leaves no room "
            f"for the KV cache after a peak of {peak / GIB:.1f} GiB (weights {weights / GIB:.1f} GiB), "
            f"{graph_bytes / GIB:.2f} GiB of CUDA graphs and {outside / GIB:.1f} GiB used outside this "
            "process's allocator; raise it, lower max_num_batched_tokens or max_num_seqs, or pass enforce_eager"
        )
    logger.info(
        "kv cache: %d blocks x %d tokens = %d tokens (%.2f GiB) = %.2f x %.2f GiB - %.2f in use - "
        "%.2f peak (weights %.2f) - %.2f cuda graphs",
        blocks, runner.block_size, blocks * runner.block_size, blocks * block_bytes / GIB,
        utilization, total / GIB, outside / GIB, peak / GIB, weights / GIB,
        graph_bytes / GIB,
    )
    return blocks


@torch.inference_mode()
def profile_peak_bytes(runner: "ModelRunner") -> int:
    """Allocator peak of a forward at the largest step (weights included), cache excluded.

    The step has ``max_num_batched_tokens`` tokens spread over up to ``max_num_seqs``
    sequences, every one sampled, so the logits are as large as they can get; the
    sampler's largest temporaries (probabilities sorted over the vocabulary) follow.
    """
    scheduler = runner.config.scheduler
    dev = runner.device
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    num_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * scheduler.max_model_len)
    num_seqs = max(1, min(scheduler.max_num_seqs, num_tokens))
    per_seq = num_tokens // num_seqs
    lens = [per_seq] * num_seqs
    lens[-1] += num_tokens - per_seq * num_seqs
    blocks_per_seq = -(-max(lens) // runner.block_size)
    cache = scratch_cache(runner, blocks_per_seq * num_seqs)
    cache_bytes = cache.gpu.numel() * cache.gpu.element_size()
    inputs = dummy_inputs(runner, lens, blocks_per_seq)
    hidden = runner.model(inputs.input_ids, inputs.positions,
                          ForwardContext(inputs.attn, cache.kv_caches, runner.backend))
    logits = runner.model.compute_logits(hidden[inputs.logits_indices])  # (num_seqs, V)
    del hidden
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_reserved(dev) - cache_bytes
    del cache, logits, probs, sorted_probs, order, inputs
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def estimate_graph_bytes(runner: "ModelRunner") -> int:
    """Device memory the decode graphs will take: a trial capture of the largest size
    (static buffers and the shared pool) and of size 1 (what each further graph adds)."""
    if not runner.graph_batch_sizes:
        return 0
    dev = runner.device
    cache = scratch_cache(runner, 1)
    torch.cuda.synchronize(dev)
    free_before = torch.cuda.mem_get_info(dev)[0]
    graphs = runner.new_decode_graphs(cache, [runner.graph_batch_sizes[-1], 1])
    graphs.capture([runner.graph_batch_sizes[-1]])
    free_first = torch.cuda.mem_get_info(dev)[0]
    graphs.capture([1])
    free_second = torch.cuda.mem_get_info(dev)[0]
    first = max(0, free_before - free_first)
    each = max(0, free_first - free_second)
    graphs.release()
    del graphs, cache
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return first + each * (len(runner.graph_batch_sizes) - 1)


def scratch_cache(runner: "ModelRunner", num_blocks: int) -> CacheEngine:
    """A throwaway device cache of ``num_blocks`` blocks for profiling, no swap pool."""
    return CacheEngine(runner.config.shape, runner.block_size, num_blocks, 0, runner.config.kv_dtype,
                       runner.device)


def dummy_inputs(runner: "ModelRunner", lens: list[int], blocks_per_seq: int) -> StepInputs:
    """A prompt step of sequences ``lens`` long, each in its own ``blocks_per_seq`` blocks."""
    dev = runner.device
    bs = runner.block_size
    positions = torch.cat([torch.arange(n) for n in lens])
    tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32).view(len(lens), blocks_per_seq)
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    attn = AttentionMetadata(slots.to(dev), tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                             cu.to(dev), max(lens), max(lens), all(n == 1 for n in lens))
    empty = torch.empty((0, 2), dtype=torch.long)
    return StepInputs(torch.zeros(len(positions), dtype=torch.long, device=dev), positions.to(dev), attn,
                      (cu[1:] - 1).long().to(dev), empty, empty)
