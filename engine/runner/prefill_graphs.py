"""Piecewise CUDA graphs for prompt-carrying steps: everything but attention, replayed.

An eager prompt-carrying step launches some three hundred kernels, and on the GPUs we run
the host takes longer to launch them than the GPU to run them (docs/BENCHMARKS.md: 15 of an
idle engine's 19 ms TTFT for a 256-token prompt). Attention reads the step's own metadata
(how many sequences, decodes and query tokens: the kernels' grids), so it stays eager; the
rest of the model does not depend on it. Each stretch between two attentions (the previous
layer's output projection, norm and MLP, this layer's norm and q/k/v projection) is captured
once per padded token count and replayed, so a step costs one replay and the attention
launches per layer:

    piece 0:  embed, layer 0 before attention             -> q, k, v, residual
    piece i:  layer i-1 after attention, layer i before   -> q, k, v, residual
    piece L:  layer L-1 after attention, final norm       -> hidden

Pieces read and write static buffers; the rows past the step's tokens are padding that
attention never sees (it gets the real rows only) and the caller never reads.

A step of prompts of up to ``max_seqs`` sequences needs no piece boundary at all: the
prefill kernel's grid depends only on the token count and the number of sequences, so the
whole forward, attention included, is captured once per size over static metadata whose
padding sequences are empty and whose padding tokens store nothing. Decodes of short
contexts (``max_decode_context``) ride along as one-token queries of the prefill kernel. That
is the step an idle engine's request runs, and the one that seats an interactive job over a
bulk backlog (it holds the bulk decodes back, not the other interactive jobs' decodes): one
replay each.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.runner.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext
from engine.runner.cuda_graph import capture_graph

logger = logging.getLogger(__name__)

# NOTE: sequences a whole-step graph holds; its padding sequences cost one empty program per
# KV head each in the prefill kernel's grid
MAX_WHOLE_SEQS = 16
# NOTE: the longest context of a decode that a whole-step graph takes: the prefill kernel gives
# a one-token query one program per KV head over its whole context, where the decode kernel
# splits long contexts over many; short ones (an interactive job's) cost about the same either way
MAX_WHOLE_DECODE_CONTEXT = 2048
# NOTE: how often a launch of pieces calls ``run``'s ``between``: 16 times for 32 layers (every 4 layers
# left an arrival waiting up to 8.5 ms at p99 on an H100, docs/BENCHMARKS.md)
BETWEEN_LAYERS = 2


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """The padded token counts captured: 16, 32, 48, ... 256 (steps of 16), 288, ... 512 (of
    32), 576, ... 1024 (of 64), then steps of 128, cut at ``max_tokens``, which is always
    included. A step pads to the next size: at most an eighth more rows past 128 tokens."""
    if max_tokens < 1:
        return []
    ladder = [*range(16, 257, 16), *range(288, 513, 32), *range(576, 1025, 64), *range(1152, max_tokens + 1, 128)]
    return [s for s in ladder if s < max_tokens] + [max_tokens]


class PrefillGraphs:
    """Static buffers and the graphs of every piece at every captured size, one memory pool.

    ``eager=True`` runs the same pieces over the same buffers without capturing them (CPU,
    and the tests that hold the pieces to the model's own forward).
    """

    def __init__(self, model: nn.Module, token_sizes: list[int], dtype: torch.dtype, device: torch.device,
                 max_blocks_per_seq: int = 1, max_context_len: int = 1, max_seqs: int = MAX_WHOLE_SEQS,
                 max_decode_context: int = MAX_WHOLE_DECODE_CONTEXT, eager: bool = False) -> None:
        if not token_sizes:
            raise ValueError("token_sizes must name at least one size")
        self.model = model
        self.inner = model.model  # embed_tokens, layers, norm
        self.layers = list(self.inner.layers)
        self.token_sizes = sorted(token_sizes)
        self.eager = eager
        n = self.token_sizes[-1]
        attn = self.layers[0].self_attn
        self.q_width = attn.num_heads * attn.head_dim
        self.kv_width = attn.num_kv_heads * attn.head_dim
        hidden_size = self.inner.embed_tokens.weight.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.qkv = torch.zeros((n, self.q_width + 2 * self.kv_width), dtype=dtype, device=device)  # (n, (Hq+2Hkv)*D)
        self.attn_out = torch.zeros((n, self.q_width), dtype=dtype, device=device)  # (n, Hq*D)
        self.residual = torch.zeros((n, hidden_size), dtype=dtype, device=device)  # (n, H)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)  # (n, H): the last piece's output
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (piece, size) -> graph
        # the whole-step graphs' static metadata: padding tokens store nothing (slot -1),
        # padding sequences are empty (their query starts and ends at the step's last token)
        self.max_seqs = max_seqs
        self.max_decode_context = max_decode_context
        self.last_run = "piece_graphs"  # how the last step ``run`` took ran: "whole_graph" or "piece_graphs"
        self.max_context_len = max_context_len
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}  # size -> graph of the whole forward
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.backend: AttentionBackend | None = None
        self.pool = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv[:size]
        q_end = self.q_width
        return qkv[:, :q_end], qkv[:, q_end:q_end + self.kv_width], qkv[:, q_end + self.kv_width:]

    def _keep_qkv(self, size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
        for buffer, value in zip(self._views(size), (q, k, v)):
            buffer.copy_(value)
        self.residual[:size].copy_(residual)

    def _piece(self, index: int, size: int) -> None:
        """Piece ``index`` over the first ``size`` rows of the static buffers."""
        residual = self.residual[:size]
        if index == 0:
            hidden = self.inner.embed_tokens(self.input_ids[:size])  # (size, H)
            *qkv, residual = self.layers[0].pre_attention(hidden, None)
            self._keep_qkv(size, *qkv, residual)
            return
        hidden, residual = self.layers[index - 1].post_attention(self.attn_out[:size], residual)
        if index < len(self.layers):
            *qkv, residual = self.layers[index].pre_attention(hidden, residual)
            self._keep_qkv(size, *qkv, residual)
        else:
            self.hidden[:size].copy_(self.inner.final_norm(hidden, residual))

    def _whole_step(self, size: int) -> None:
        """The model's forward, attention included, over the static metadata at ``size`` tokens."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables, context_lens=self.context_lens,
            query_start_loc=self.query_start_loc, max_query_len=size, max_context_len=self.max_context_len,
            decode_only=False,
        )
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        self.hidden[:size].copy_(self.model(self.input_ids[:size], self.positions[:size], ctx))

    def attach(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend) -> None:
        """The cache and backend the whole-step graphs attend with (the pieces need neither)."""
        self.kv_caches, self.backend = kv_caches, backend

    @torch.inference_mode()
    def capture_whole(self, token_sizes: list[int] | None = None) -> None:
        """Capture the whole-step graph at the given sizes (default: all) after ``attach``.

        NOTE: the static metadata holds no sequence while capturing (every query empty, every
        slot -1), so neither the warm-ups nor the captures touch the cache.
        """
        if self.kv_caches is None:
            raise RuntimeError("attach the KV cache before capturing whole-step graphs")
        if self.eager:
            return
        self.query_start_loc.zero_()
        self.context_lens.zero_()
        self.slot_mapping.fill_(-1)
        device = self.stream.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        for size in sorted(token_sizes or self.token_sizes, reverse=True):
            graph = capture_graph(functools.partial(self._whole_step, size), self.stream, self.pool)
            self.pool = graph.pool()
            self.whole[size] = graph
        torch.cuda.synchronize(device)

    @torch.inference_mode()
    def capture(self, token_sizes: list[int] | None = None) -> None:
        """Capture every piece at the given sizes (default: all), largest first so the smaller
        reuse the pool. Pieces read only the static buffers: no KV cache is needed yet."""
        if self.eager:
            return
        start = time.perf_counter()
        device = self.stream.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        for size in sorted(token_sizes or self.token_sizes, reverse=True):
            for index in range(self.num_pieces):
                graph = capture_graph(functools.partial(self._piece, index, size), self.stream, self.pool)
                self.pool = graph.pool()
                self.graphs[(index, size)] = graph
        torch.cuda.synchronize(device)
        logger.debug("captured %d prefill pieces in %.1f s", len(self.graphs), time.perf_counter() - start)

    def release(self) -> None:
        """Destroy every graph (before leaving a tensor-parallel group: see ``DecodeGraphs.release``)."""
        if not self.graphs and not self.whole:
            return
        torch.cuda.synchronize(self.stream.device)
        for graph in (*self.graphs.values(), *self.whole.values()):
            graph.reset()
        self.graphs.clear()
        self.whole.clear()
        self.pool = None

    def _run_piece(self, index: int, size: int) -> None:
        if self.eager:
            self._piece(index, size)
        else:
            self.graphs[(index, size)].replay()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
            between: Callable[[], object] | None = None) -> torch.Tensor | None:
        """The model's forward over a step of up to ``max_tokens`` tokens: returns the (T, H)
        hidden states (a view of the static output), or None when no captured size holds it.

        ``between``: called every ``BETWEEN_LAYERS`` layers while the pieces are launched (the
        express lane's look for arrivals: launching a step of pieces and eager attentions takes
        the host about as long as the GPU takes to run it)."""
        num_tokens = input_ids.shape[0]
        if num_tokens == 0 or num_tokens > self.max_tokens:
            return None
        size = self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)]
        meta = ctx.attn
        if self._takes_whole(ctx, size):
            self.last_run = "whole_graph"
            return self._run_whole(input_ids, positions, meta, size)
        if not self.eager and (0, size) not in self.graphs:
            return None
        self.last_run = "piece_graphs"
        self.input_ids[:num_tokens].copy_(input_ids)
        q, k, v = (view[:num_tokens] for view in self._views(num_tokens))
        self._run_piece(0, size)
        for index, layer in enumerate(self.layers, start=1):
            # attention over the real rows only: it stores their keys and values, reads the cache
            # and writes the next piece's input
            layer.self_attn.attend(q, k, v, positions, ctx, out=self.attn_out[:num_tokens])  # (T, Hq*D)
            self._run_piece(index, size)
            if between is not None and index % BETWEEN_LAYERS == 0:
                between()
        return self.hidden[:num_tokens]

    def _takes_whole(self, ctx: ForwardContext, size: int) -> bool:
        """Prompts (and decodes of short contexts), few enough sequences, block tables that fit,
        the cache the graphs hold."""
        meta = ctx.attn
        if meta.decode_only or ctx.kv_caches is not self.kv_caches:
            return False
        if meta.num_decodes and meta.max_context_len > self.max_decode_context:
            return False
        if meta.context_lens.shape[0] > self.max_seqs or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return False
        return self.eager or size in self.whole

    def _run_whole(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   size: int) -> torch.Tensor:
        num_tokens, num_seqs = input_ids.shape[0], meta.context_lens.shape[0]
        width = meta.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)  # padding tokens store nothing
        self.query_start_loc[:num_seqs + 1].copy_(meta.query_start_loc)
        self.query_start_loc[num_seqs + 1:].fill_(num_tokens)  # padding sequences are empty
        self.context_lens[:num_seqs].copy_(meta.context_lens)
        self.context_lens[num_seqs:].fill_(0)
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if self.eager:
            self._whole_step(size)
        else:
            self.whole[size].replay()
        return self.hidden[:num_tokens]
