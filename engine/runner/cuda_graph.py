"""CUDA graphs for decode-only steps: one graph per padded batch size, replayed over static buffers.

A decode step launches a few hundred small kernels; at small batches launching them costs
more than running them. Each graph is captured once at start-up for a batch size of the
ladder and replayed for any batch of up to that many sequences: the step's inputs are
copied into the static buffers the graph reads, and the rows past the real batch are
padding that writes nothing (slot -1) and attends to nothing (context length 0).

Up to ``head_batch`` sequences a graph also runs the LM head and what the sampler needs of the
raw logits (``LogitStats``: each row's argmax and logsumexp, and a greedy choice's host rows),
so an all-greedy batch-1 step launches nothing outside its graph but the copy to the host.
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
from engine.runner.sampler import LogitStats, logit_stats

logger = logging.getLogger(__name__)

# NOTE: past this batch a decode step's kernels run longer than Python takes to launch them,
# so eager execution loses nothing and the graphs' start-up time and memory are saved.
MAX_CAPTURE_BATCH = 512
# NOTE: the LM head runs inside the graphs of up to this many sequences. Each such graph keeps
# its own (B, vocab) float32 logits (16 sequences of llama3's vocabulary: 8 MB; every size up
# to 16: 16 MB); past a few sequences the step's own kernels hide the head's few launches.
HEAD_BATCH = 16


def capture_graph(fn: Callable[[], None], stream: torch.cuda.Stream, pool: tuple | None) -> torch.cuda.CUDAGraph:
    """``fn`` run once on ``stream`` (a warm-up: kernels compile, libraries set up their
    workspaces, outside the capture), then captured into a new graph allocating from ``pool``
    (None: a new pool, ``graph.pool()`` then shares it), then replayed once.

    NOTE: the replay is the capture's inputs once more (callers capture over padding that
    writes nothing); it makes the driver upload the graph at start-up rather than in the
    first step that needs it, whose launch would carry that cost."""
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    with torch.cuda.stream(stream):
        graph.replay()
    return graph


def capture_batch_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_BATCH) -> list[int]:
    """The ladder 1, 2, 4, 8, 16, 24, ... 256 (steps of 8), 272, ... 512 (steps of 16), cut at
    ``min(max_num_seqs, limit)``, which is always included."""
    top = max(1, min(max_num_seqs, limit))
    ladder = [1, 2, 4, 8, *range(16, 257, 8), *range(272, 513, 16)]
    sizes = [s for s in ladder if s < top]
    return sizes + [top]


class DecodeGraphs:
    """Static input buffers, one output buffer and a graph per batch size, sharing one memory pool."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        max_context_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        # (B, H) hidden states -> (B, V) float32 logits, run inside the graphs of up to HEAD_BATCH sequences
        self.head = head
        self.head_batch = HEAD_BATCH if head is not None else 0
        self.heads: dict[int, tuple[torch.Tensor, LogitStats]] = {}  # batch size -> the graph's logits and stats
        self.last_batch_size = 0
        self.kv_caches = kv_caches
        self.backend = backend
        self.batch_sizes = sorted(batch_sizes)
        # NOTE: the decode kernel picks its split count from this host-side bound, the same
        # for every replay, so a graph stays valid for any context up to max_model_len.
        self.max_context_len = max_context_len
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)  # (n, H)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.stream = torch.cuda.Stream(device)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _forward(self, bs: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1, max_context_len=self.max_context_len, decode_only=True,
        )
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        if bs <= self.head_batch:
            logits = self.head(self.hidden[:bs])  # (bs, V)
            # NOTE: the last call is the capture: these tensors are then the graph's own outputs
            self.heads[bs] = (logits, logit_stats(logits))

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int] | None = None) -> None:
        """Capture the given sizes (default: all), largest first so the smaller reuse its pool."""
        start = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        for bs in sorted(batch_sizes or self.batch_sizes, reverse=True):
            graph = capture_graph(functools.partial(self._forward, bs), self.stream, self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.stream.device)
        logger.debug("captured %d decode graphs in %.1f s", len(self.graphs), time.perf_counter() - start)

    def release(self) -> None:
        """Destroy every graph and the static buffers' pool.

        NOTE: NCCL counts each live graph that captured one of its collectives and will not
        destroy a communicator while any is left: a tensor-parallel rank must release its
        graphs before it leaves the process group, or leaving hangs.
        """
        if not self.graphs:
            return
        torch.cuda.synchronize(self.stream.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.heads.clear()
        self.pool = None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Replay the graph of the smallest captured size that holds the batch; returns the
        (B, H) hidden states (a view of the static output), or None when no graph fits."""
        num_seqs = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        if not meta.decode_only or num_seqs > self.max_batch_size or width > self.block_tables.shape[1]:
            return None
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        if bs not in self.graphs:
            return None
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.context_lens[:num_seqs].copy_(meta.context_lens)
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if bs > num_seqs:
            self.slot_mapping[num_seqs:bs].fill_(-1)  # padding rows write no cache slot
            self.context_lens[num_seqs:bs].fill_(0)  # and attend to nothing
        self.graphs[bs].replay()
        self.last_batch_size = bs
        return self.hidden[:num_seqs]

    def head_outputs(self, num_seqs: int) -> tuple[torch.Tensor, LogitStats] | None:
        """The (num_seqs, V) logits and their ``LogitStats`` of the graph ``run`` replayed last,
        when that graph ran the LM head (None otherwise)."""
        found = self.heads.get(self.last_batch_size)
        if found is None:
            return None
        logits, stats = found
        return logits[:num_seqs], stats.rows(num_seqs)
