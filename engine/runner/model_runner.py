"""One rank's model runner: turns a scheduled step into tensors, runs the model, returns logits."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from engine.runner.attention import get_attention_backend
from engine.runner.attention.metadata import AttentionMetadata, ForwardContext
from engine.runner.cache_engine import CacheEngine
from engine.runner.kv_sizing import GIB, num_gpu_blocks
from engine.runner.step_inputs import StepInputs
from engine.executor.distributed import broadcast_from_rank0, min_over_ranks, tp_rank, tp_size
from engine.runner.cuda_graph import DecodeGraphs, capture_batch_sizes
from engine.runner.prefill_graphs import PrefillGraphs, prefill_token_sizes
from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.core.swap import swap_chunk_blocks, swap_pool_blocks
from engine.runner.prompt_logprobs import prompt_logit_positions
from engine.runner.warm_up import compile_mixed_steps

logger = logging.getLogger(__name__)


class ModelRunner:
    """Rank ``rank``'s model shard and KV cache; at TP > 1 the process must already have
    joined the tensor-parallel group (``engine.executor.distributed.init_tensor_parallel``)."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        from engine.models.loader import load_model

        model, cache = config.model, config.cache
        tp = config.parallel.tensor_parallel_size
        if tp_size() != tp or tp_rank() != rank:
            raise RuntimeError(
                f"this process is rank {tp_rank()} of a tensor-parallel group of {tp_size()}, but the runner "
                f"is for rank {rank} of {tp}; one tensor-parallel engine per process: "
                "shut the other engine down first"
            )
        self.config = config
        self.rank = rank
        self.device = torch.device("cuda", rank) if model.device.type == "cuda" else model.device
        self.block_size = cache.block_size
        self.max_blocks_per_seq = -(-model.max_model_len // cache.block_size)
        self.model, _ = load_model(model.model, model.load_format, model.dtype, self.device, hf_config=model.hf_config,
                                   max_model_len=model.max_model_len, seed=model.seed,
                                   quantization=model.quantization, kv_cache_dtype=config.kv_dtype)
        self.backend = get_attention_backend(model.attention_backend, self.device)
        if model.small_batch_kernels:
            folded = self.model.use_small_batch_kernels(True)
            logger.info("small-batch kernels: %d of %d layers fold their norms and SwiGLU into the projections",
                        folded, model.hf_config.num_hidden_layers)
        use_graphs = self.device.type == "cuda" and not model.enforce_eager
        self.last_forward: str | None = None  # how ``execute`` ran the last forward (StepRecord.forward)
        self.last_logit_stats: LogitStats | None = None  # the last forward's, when a decode graph ran the LM head
        self.graph_batch_sizes = capture_batch_sizes(config.scheduler.max_num_seqs) if use_graphs else []
        # NOTE: captured before the cache is sized: the pieces need no cache, and their pool is
        # then part of what the profile finds reserved
        self.prefill_graphs = self._capture_prefill_graphs() if use_graphs and model.prefill_graph_tokens else None
        # NOTE: every rank must index the same blocks, so all take the smallest count any can hold.
        self.num_gpu_blocks = min_over_ranks(cache.num_gpu_blocks_override or num_gpu_blocks(self))
        self.num_cpu_blocks = swap_pool_blocks(cache.swap_bytes, config)
        self.cache = CacheEngine(config.shape, cache.block_size, self.num_gpu_blocks, swap_chunk_blocks(config),
                                 config.kv_dtype, self.device)
        # NOTE: the configured pool is pinned before the engine serves, not in the first steps that swap
        self.cache.reserve(self.num_cpu_blocks // self.cache.chunk_blocks, wait=True)
        self.graphs = self._capture_graphs() if self.graph_batch_sizes else None
        if self.prefill_graphs is not None:  # the whole-step graphs attend over this cache
            self._capture_whole_prefill_graphs()
        # the express lane (EngineArgs.express_lane_tokens): a high-priority stream, and whole-step
        # graphs of its own (buffers and pool) so that they can run while the others replay
        express = config.scheduler.express_lane_tokens
        self.express_stream = torch.cuda.Stream(self.device, priority=-1) if express and self.device.type == "cuda" else None
        self.express_graphs = self._capture_express_graphs(express) if express and use_graphs else None
        if self.device.type == "cuda":  # NOTE: no kernel variant compiles mid-run (engine/runner/warm_up.py)
            compile_mixed_steps(self)

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs (before leaving a tensor-parallel group: see ``DecodeGraphs.release``)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None

    def _capture_cost(self, capture: Callable[[], object]) -> tuple[float, float]:
        """Run ``capture``: the seconds it took and the GiB of device memory it kept."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        capture()
        return time.perf_counter() - start, (free_before - torch.cuda.mem_get_info(self.device)[0]) / GIB

    def _capture_prefill_graphs(self) -> PrefillGraphs:
        config = self.config
        limit = min(config.model.prefill_graph_tokens, config.scheduler.max_num_batched_tokens)
        graphs = PrefillGraphs(self.model, prefill_token_sizes(limit), config.model.dtype, self.device,
                               max_blocks_per_seq=self.max_blocks_per_seq, max_context_len=config.model.max_model_len)
        seconds, gib = self._capture_cost(graphs.capture)
        logger.info("cuda graphs: %d pieces x %d prompt step sizes (16..%d tokens) captured in %.1f s, %.2f GiB",
                    graphs.num_pieces, len(graphs.token_sizes), limit, seconds, gib)
        return graphs

    def _capture_whole_prefill_graphs(self) -> None:
        # NOTE: after the cache is sized: they reuse the pieces' pool, which already holds a
        # piece's largest temporaries; what they add (q, k, v and attention's output in the
        # pool rather than static buffers) is logged here
        self.prefill_graphs.attach(self.cache.kv_caches, self.backend)
        seconds, gib = self._capture_cost(self.prefill_graphs.capture_whole)
        logger.info("cuda graphs: whole prompt steps (up to %d sequences) at %d sizes captured in %.1f s, %.2f GiB",
                    self.prefill_graphs.max_seqs, len(self.prefill_graphs.whole), seconds, gib)

    def _capture_express_graphs(self, tokens: int) -> PrefillGraphs:
        config = self.config
        graphs = PrefillGraphs(self.model, prefill_token_sizes(tokens), config.model.dtype, self.device,
                               max_blocks_per_seq=self.max_blocks_per_seq, max_context_len=config.model.max_model_len,
                               max_seqs=1)
        graphs.attach(self.cache.kv_caches, self.backend)
        seconds, gib = self._capture_cost(graphs.capture_whole)
        logger.info("cuda graphs: the express lane's prompt steps (16..%d tokens) captured in %.1f s, %.2f GiB",
                    tokens, seconds, gib)
        return graphs

    @contextlib.contextmanager
    def express_lane(self) -> Iterator[None]:
        """Launch what the body launches on the express lane's high-priority stream (CUDA)."""
        if self.express_stream is None:
            yield
            return
        with torch.cuda.stream(self.express_stream):
            yield

    # ----- sizing ---------------------------------------------------------------------
    def resize_swap_pool(self, num_blocks: int) -> int:
        """Follow the block manager's swap pool to ``num_blocks`` (whole chunks): host memory of
        chunks past the end is released; new chunks are pinned in the background (on CUDA)."""
        self.cache.truncate(num_blocks // self.cache.chunk_blocks)
        self.cache.reserve(num_blocks // self.cache.chunk_blocks)
        self.num_cpu_blocks = num_blocks
        return num_blocks

    def new_decode_graphs(self, cache: CacheEngine, batch_sizes: list[int]) -> DecodeGraphs:
        config = self.config
        return DecodeGraphs(
            self.model, cache.kv_caches, self.backend, batch_sizes, self.max_blocks_per_seq,
            config.model.max_model_len, config.shape.hidden_size, config.model.dtype, self.device,
            head=self.model.compute_logits,
        )

    def _capture_graphs(self) -> DecodeGraphs:
        graphs = self.new_decode_graphs(self.cache, self.graph_batch_sizes)
        seconds, gib = self._capture_cost(graphs.capture)
        logger.info("cuda graphs: %d decode batch sizes (1..%d) captured in %.1f s, %.2f GiB",
                    len(self.graph_batch_sizes), self.graph_batch_sizes[-1], seconds, gib)
        return graphs

    # ----- a step ---------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, device: torch.device | None = None) -> StepInputs:
        """Flatten the scheduled sequences into one varlen batch (rank 0 only).

        Integers are gathered in Python lists, written into two pinned host buffers and
        sent to the device in two copies; every tensor of the step is a view of those.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        num_tokens = 0
        max_query_len = 0
        num_decodes = 0  # leading single-token queries
        feed: list[int] = []  # flat (input row, sampled row) pairs
        prompt_rows: list[int] = []  # rows whose logits give prompt logprobs
        for item in out.scheduled:
            seq, start, n = item.seq, item.num_computed_tokens, item.num_new_tokens
            if seq.prompt_logprobs_from is not None:
                wanted = prompt_logit_positions(item)
                prompt_rows.extend(range(num_tokens + wanted.start - start, num_tokens + wanted.stop - start))
            end = start + n
            table = seq.block_table
            if end > len(seq.token_ids):  # the last input is the pending token: fed on the device
                feed += (num_tokens + n - 1, seq.pending_row)
            if n == 1:  # a decode token
                input_ids.append(seq.token_ids[start] if start < len(seq.token_ids) else 0)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                chunk = seq.token_ids[start:end]
                input_ids.extend(chunk if len(chunk) == n else chunk + [0])
                positions.extend(range(start, end))
                for page in range(start // bs, (end - 1) // bs + 1):
                    base = table[page] * bs
                    slots.extend(range(base + max(start - page * bs, 0), base + min(end - page * bs, bs)))
            if n == 1 and num_decodes == len(tables):
                num_decodes += 1
            num_tokens += n
            max_query_len = max(max_query_len, n)
            context_lens.append(end)
            query_start.append(num_tokens)
            tables.append(table)
            if item.samples:
                logits_indices.append(num_tokens - 1)
        num_seqs = len(tables)
        width = max((len(t) for t in tables), default=1) or 1
        logits_indices += prompt_rows

        pin = self.device.type == "cuda"
        n_ids = len(logits_indices)
        host64 = torch.empty(3 * num_tokens + n_ids + len(feed), dtype=torch.long, pin_memory=pin)
        a64 = host64.numpy()
        a64[:num_tokens] = input_ids
        a64[num_tokens : 2 * num_tokens] = positions
        a64[2 * num_tokens : 3 * num_tokens] = slots
        a64[3 * num_tokens : 3 * num_tokens + n_ids] = logits_indices
        a64[3 * num_tokens + n_ids :] = feed
        host32 = torch.empty(2 * num_seqs + 1 + num_seqs * width, dtype=torch.int32, pin_memory=pin)
        a32 = host32.numpy()
        a32[:num_seqs] = context_lens
        a32[num_seqs : 2 * num_seqs + 1] = query_start
        block_tables = a32[2 * num_seqs + 1 :].reshape(num_seqs, width)
        _fill_rows(block_tables, tables)
        # NOTE: ``device`` is the host when rank 0 ships the step to the other ranks first.
        dev = self.device if device is None else device
        dev64 = host64.to(dev, non_blocking=True)
        dev32 = host32.to(dev, non_blocking=True)

        attn = AttentionMetadata(
            slot_mapping=dev64[2 * num_tokens : 3 * num_tokens],
            block_tables=dev32[2 * num_seqs + 1 :].view(num_seqs, width),
            context_lens=dev32[:num_seqs],
            query_start_loc=dev32[num_seqs : 2 * num_seqs + 1],
            max_query_len=max_query_len,
            max_context_len=max(context_lens, default=0),
            decode_only=max_query_len == 1,
            num_decodes=num_decodes if max_query_len > 1 else 0,
        )
        return StepInputs(
            input_ids=dev64[:num_tokens],
            positions=dev64[num_tokens : 2 * num_tokens],
            attn=attn,
            logits_indices=dev64[3 * num_tokens : 3 * num_tokens + n_ids],
            swap_out=torch.tensor(out.blocks_to_swap_out, dtype=torch.long).view(-1, 2),
            swap_in=torch.tensor(out.blocks_to_swap_in, dtype=torch.long).view(-1, 2),
            feed=dev64[3 * num_tokens + n_ids :].view(-1, 2) if feed else None,
            num_prompt_rows=len(prompt_rows),
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, fed_tokens: torch.Tensor | None = None, express: bool = False,
                between: Callable[[], object] | None = None) -> torch.Tensor | None:
        """Swap blocks, run the forward, return (N, V) float32 logits of the sampled rows.

        ``fed_tokens``: the previous step's sampled token ids on the device, for the inputs
        ``inputs.feed`` names; only rank 0 samples, so it broadcasts the ones fed to the other
        ranks. A decode-only batch that a captured graph holds replays it; anything else runs
        eagerly. ``express``: a step of the express lane (inside ``express_lane()``), which
        replays the lane's own graphs only, beside whatever the others replay; ``between``: what
        a launch of graph pieces calls between layers (``PrefillGraphs.run``).
        """
        self.cache.swap_out(inputs.swap_out)
        self.cache.swap_in(inputs.swap_in)
        if inputs.feed is not None:
            if self.rank == 0:
                if fed_tokens is None:
                    raise RuntimeError("this step's inputs wait on the previous step's sampled tokens, "
                                       "which were not passed")
                fed = fed_tokens.index_select(0, inputs.feed[:, 1]).to(inputs.input_ids.dtype)
            else:
                fed = torch.empty(inputs.feed.shape[0], dtype=inputs.input_ids.dtype, device=self.device)
            inputs.input_ids.index_copy_(0, inputs.feed[:, 0], broadcast_from_rank0(fed))
        self.last_forward = None
        self.last_logit_stats = None
        if inputs.input_ids.numel() == 0:
            return None
        hidden = None
        if express:
            ctx = ForwardContext(inputs.attn, self.cache.kv_caches, self.backend)
            if self.express_graphs is not None:
                hidden = self.express_graphs.run(inputs.input_ids, inputs.positions, ctx)
                self.last_forward = "express_graph" if hidden is not None else None
            if hidden is None:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # (T, H)
                self.last_forward = "eager"
        elif self.graphs is not None and inputs.attn.decode_only:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn)  # (B, H) or None
            self.last_forward = "decode_graph" if hidden is not None else None
            head = self.graphs.head_outputs(hidden.shape[0]) if hidden is not None else None
            if head is not None and not inputs.num_prompt_rows and inputs.logits_indices.shape[0] == hidden.shape[0]:
                logits, self.last_logit_stats = head
                return logits  # (B, V): the graph ran the LM head too
        if hidden is None:
            ctx = ForwardContext(inputs.attn, self.cache.kv_caches, self.backend)
            if self.prefill_graphs is not None:
                hidden = self.prefill_graphs.run(inputs.input_ids, inputs.positions, ctx, between)  # (T, H) or None
                self.last_forward = self.prefill_graphs.last_run if hidden is not None else None
            if hidden is None:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # (T, H)
                self.last_forward = "eager"
        if inputs.logits_indices.numel() == 0:
            return None
        if inputs.num_prompt_rows or hidden.shape[0] != inputs.logits_indices.shape[0]:
            hidden = hidden[inputs.logits_indices]  # (N + M, H): only the sampled (and prompt) rows reach the LM head
        return self.model.compute_logits(hidden)  # (N + M, V)


def _fill_rows(matrix: np.ndarray, rows: list[list[int]]) -> None:
    """Copy ragged rows into the left of a zeroed (len(rows), width) matrix."""
    matrix.fill(0)
    for i, row in enumerate(rows):
        matrix[i, : len(row)] = row
