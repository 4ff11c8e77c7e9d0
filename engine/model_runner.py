"""One rank's model runner: turns a scheduled step into tensors, runs the model, returns logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.attention import get_attention_backend
from engine.attention.metadata import AttentionMetadata, ForwardContext
from engine.cache_engine import CacheEngine
from engine.distributed import min_over_ranks, tp_rank, tp_size
from engine.model_info import ModelInfo
from engine.scheduler import SchedulerOutput
from engine.swap import swap_chunk_blocks, swap_pool_blocks

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET_BYTES = 2 << 30  # KV cache on CPU devices when no block count is given


@dataclass
class StepInputs:
    """Everything every rank needs for one forward; built once, on rank 0."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) int64: rows of the hidden states to sample from
    # block pairs index the host pool too, so they stay on the host (``on_host``: how a
    # rank rebuilding these inputs from rank 0's message knows)
    swap_out: torch.Tensor = field(metadata={"on_host": True})  # (K, 2) int64 (gpu, cpu)
    swap_in: torch.Tensor = field(metadata={"on_host": True})  # (K, 2) int64 (cpu, gpu)


class ModelRunner:
    """Rank ``rank``'s model shard and KV cache; at TP > 1 the process must already have
    joined the tensor-parallel group (``engine.distributed.init_tensor_parallel``)."""

    def __init__(self, info: ModelInfo, num_gpu_blocks: int | None = None, rank: int = 0) -> None:
        from engine.model_loader import load_model

        if tp_size() != info.tensor_parallel_size or tp_rank() != rank:
            raise RuntimeError(
                f"this process is rank {tp_rank()} of a tensor-parallel group of {tp_size()}, but the runner "
                f"is for rank {rank} of {info.tensor_parallel_size}; one tensor-parallel engine per process: "
                "shut the other engine down first"
            )
        self.info = info
        self.device = torch.device("cuda", rank) if info.device.type == "cuda" else info.device
        self.block_size = info.block_size
        self.model, _ = load_model(info.model, info.load_format, info.dtype, self.device, hf_config=info.hf_config,
                                   max_model_len=info.max_model_len, seed=info.seed)
        self.backend = get_attention_backend(info.attention_backend, self.device)
        # NOTE: every rank must index the same blocks, so all take the smallest count any can hold.
        self.num_gpu_blocks = min_over_ranks(num_gpu_blocks or self._decide_num_gpu_blocks())
        self.num_cpu_blocks = swap_pool_blocks(info.swap_bytes, info)
        self.cache = CacheEngine(
            info.num_layers, info.num_kv_heads_per_rank, info.head_dim, info.block_size,
            self.num_gpu_blocks, swap_chunk_blocks(info), info.dtype, self.device,
        )

    # ----- sizing ---------------------------------------------------------------------
    def resize_swap_pool(self, num_blocks: int) -> int:
        """Follow the block manager's swap pool to ``num_blocks`` (whole chunks): host memory of
        chunks past the end is released; new chunks take memory on their first swap-out."""
        self.cache.truncate(num_blocks // self.cache.chunk_blocks)
        self.num_cpu_blocks = num_blocks
        return num_blocks

    def _decide_num_gpu_blocks(self) -> int:
        info = self.info
        if self.device.type != "cuda":
            want = -(-info.max_model_len // info.block_size) * info.max_num_seqs
            return max(1, min(want, _CPU_KV_BUDGET_BYTES // info.bytes_per_block))
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_peak_bytes()
        usable = info.gpu_memory_utilization * total - peak
        blocks = int(usable // info.bytes_per_block)
        if blocks < 1:
            raise ValueError(
                f"gpu_memory_utilization: {info.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves no room "
                f"for the KV cache after the model's peak of {peak / 2**30:.1f} GiB; raise it or lower max_num_batched_tokens"
            )
        logger.info(
            "kv cache: %d blocks of %d tokens (%.2f GiB); peak without cache %.2f GiB of %.2f GiB",
            blocks, info.block_size, blocks * info.bytes_per_block / 2**30, peak / 2**30, total / 2**30,
        )
        return blocks

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak memory of a forward at the largest step (weights included), cache excluded."""
        info = self.info
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = info.max_num_batched_tokens
        num_seqs = max(1, min(info.max_num_seqs, num_tokens))
        per_seq = num_tokens // num_seqs
        lens = [per_seq] * num_seqs
        lens[-1] += num_tokens - per_seq * num_seqs
        blocks_per_seq = -(-max(lens) // info.block_size)
        cache = CacheEngine(info.num_layers, info.num_kv_heads_per_rank, info.head_dim, info.block_size,
                            blocks_per_seq * num_seqs, 0, info.dtype, self.device)
        cache_bytes = cache.gpu.numel() * cache.gpu.element_size()
        inputs = self._dummy_inputs(lens, blocks_per_seq)
        hidden = self.model(inputs.input_ids, inputs.positions,
                            ForwardContext(inputs.attn, cache.kv_caches, self.backend))
        self.model.compute_logits(hidden[inputs.logits_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del cache, hidden
        torch.cuda.empty_cache()
        return peak

    def _dummy_inputs(self, lens: list[int], blocks_per_seq: int) -> StepInputs:
        dev = self.device
        bs = self.block_size
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

    # ----- a step ---------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, device: torch.device | None = None) -> StepInputs:
        """Flatten the scheduled sequences into one varlen batch (rank 0 only)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        for item in out.scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            query_start.append(query_start[-1] + n)
            tables.append(table)
            if item.samples:
                logits_indices.append(query_start[-1] - 1)
        width = max((len(t) for t in tables), default=1) or 1
        block_tables = [t + [0] * (width - len(t)) for t in tables]
        # NOTE: ``device`` is the host when rank 0 ships the step to the other ranks first.
        dev = self.device if device is None else device

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype).to(dev, non_blocking=True)

        attn = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(block_tables, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            query_start_loc=tensor(query_start, torch.int32),
            max_query_len=max((s.num_new_tokens for s in out.scheduled), default=0),
            max_context_len=max(context_lens, default=0),
            decode_only=all(s.num_new_tokens == 1 for s in out.scheduled),
        )
        return StepInputs(
            input_ids=tensor(input_ids, torch.long),
            positions=tensor(positions, torch.long),
            attn=attn,
            logits_indices=tensor(logits_indices, torch.long),
            swap_out=torch.tensor(out.blocks_to_swap_out, dtype=torch.long).view(-1, 2),
            swap_in=torch.tensor(out.blocks_to_swap_in, dtype=torch.long).view(-1, 2),
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Swap blocks, run the forward, return (N, V) float32 logits of the sampled rows."""
        self.cache.swap_out(inputs.swap_out)
        self.cache.swap_in(inputs.swap_in)
        if inputs.input_ids.numel() == 0:
            return None
        ctx = ForwardContext(inputs.attn, self.cache.kv_caches, self.backend)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # (T, H)
        if inputs.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])  # (N, V)
