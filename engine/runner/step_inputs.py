"""The tensors of one forward, as rank 0 builds them and every rank runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.runner.attention.metadata import AttentionMetadata


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
    # async scheduling: inputs whose token the previous step sampled and has not read back,
    # (K, 2) int64 of (row of input_ids, row of that step's sampled tokens)
    feed: torch.Tensor | None = None
    # prompt logprobs: the last ``num_prompt_rows`` of ``logits_indices`` are prompt positions
    # (``engine/runner/prompt_logprobs.py``), after the sampled rows
    num_prompt_rows: int = 0
