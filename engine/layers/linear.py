"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes a slice of the
output, no communication); row-parallel layers split the input features and sum the
partial products with the one all-reduce of the pair. Each parameter's
``weight_loader(param, loaded_weight, shard_id=None)`` cuts this rank's shard out of the
full checkpoint tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from engine.layers.params import copy_checked, new_param, read_slice


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """``y = x A^T`` with A's rows (output features) split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.gather_output = gather_output
        self.output_size_per_rank = divide(output_size, self.tp_size, "output_size")
        self.weight = new_param(self.output_size_per_rank, input_size, weight_loader=self.weight_loader)
        self.bias = new_param(self.output_size_per_rank, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        copy_checked(param.data, read_slice(loaded, 0, self.tp_rank * size, size), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (T, out / tp)
        return all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked on the output dim (gate and up projections).

    Each rank holds ``[gate shard; up shard]`` so ``silu_and_mul`` works on local halves.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        for size in self.output_sizes:
            divide(size, self.tp_size, "merged output size")

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        src = read_slice(loaded, 0, self.tp_rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections with attention heads split across ranks.

    Query heads are split evenly. KV heads are split too when there are at least as many
    as ranks; with fewer (e.g. 8 KV heads at TP=16, or 1 at TP=2) each rank holds one KV
    head and groups of ``tp_size // total_num_kv_heads`` ranks share (replicate) it.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if tp % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp} must be a multiple of num_key_value_heads={total_num_kv_heads} "
                    "when it exceeds it"
                )
            self.num_kv_heads = 1
            self.kv_replicas = tp // total_num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, output_size, bias)
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, (self.tp_rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(param.data.narrow(0, offset, size), read_slice(loaded, 0, start, size), f"{shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """``y = x A^T`` with A's columns (input features) split; partial sums all-reduced.

    The input arrives already split (the output of a column-parallel layer), so this is
    where the pair's one all-reduce happens.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.reduce_results = reduce_results
        self.input_size_per_rank = divide(input_size, self.tp_size, "input_size")
        self.weight = new_param(output_size, self.input_size_per_rank, weight_loader=self.weight_loader)
        self.bias = new_param(output_size) if bias else None  # replicated, added once

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[1]
        copy_checked(param.data, read_slice(loaded, 1, self.tp_rank * size, size), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: only rank 0 adds the bias so that the sum over ranks counts it once.
        bias = self.bias if self.tp_rank == 0 else None
        y = F.linear(x, self.weight, bias)  # (T, out), partial over ranks
        return all_reduce(y) if self.reduce_results else y
