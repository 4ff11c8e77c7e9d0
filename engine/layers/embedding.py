"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.distributed import all_reduce, gather_logits, tp_rank, tp_size
from engine.layers.params import copy_checked, new_param, read_slice, shape_of


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous ``ceil(vocab / tp)`` rows; the last one is zero-padded."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)  # exclusive
        self.weight = new_param(self.rows_per_rank, embedding_dim, weight_loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        rows = self.vocab_end - self.vocab_start
        if shape_of(loaded)[0] != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint has {shape_of(loaded)[0]} rows, "
                             f"config vocab_size is {self.num_embeddings}")
        param.data[rows:].zero_()
        copy_checked(param.data[:rows], read_slice(loaded, 0, self.vocab_start, rows), type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # (T, H)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (T,)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        x = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # (T, H)
        return all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to full-vocab logits; shares the embedding's weight when tied."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # (N, vocab / tp)
        return gather_logits(logits, self.num_embeddings)  # (N, vocab)
