"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes a slice of the
output, no communication); row-parallel layers split the input features and sum the
partial products with the one all-reduce of the pair. Each parameter's
``weight_loader(param, loaded_weight, shard_id=None)`` cuts this rank's shard out of the
full checkpoint tensor.

With ``quantization="fp8"`` the weight is float8 e4m3 with one fp32 ``weight_scale`` per
output channel (engine/layers/fp8.py). A column-parallel shard takes its rows' scales with
it; a row-parallel shard cuts the input dim and keeps every output channel's scale, taken
over the whole row, so the ranks' partial products share one scale per channel. A
full-precision checkpoint tensor is quantized as it loads; a float8 one is copied with the
checkpoint's scales (per channel, or one per tensor spread over its rows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.distributed import all_gather_last_dim, all_reduce, all_reduce_max, tp_rank, tp_size
from engine.layers.fp8 import (FP8_DTYPE, Fp8Input, UnscaledProduct, check_quantization, fp8_linear, fp8_small_m_linear,
                               quantize_rows)
from engine.layers.params import copy_checked, new_param, read_all, read_slice, shape_of
from sluiceway_kernels._common import interpreting
from sluiceway_kernels.small_m_linear import small_m_linear, small_m_linear_ref


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def load_scale(dst: torch.Tensor, loaded: Any, start: int, size: int, what: str) -> None:
    """Fill ``dst`` (size,) from a checkpoint scale: per channel ((N,) or (N, 1), rows
    ``start:start+size`` taken) or per tensor (one value, spread over the rows)."""
    if shape_of(loaded) in ((), (1,), (1, 1)):
        dst.fill_(read_all(loaded).reshape(()).item())
    else:
        copy_checked(dst, read_slice(loaded, 0, start, size).reshape(-1), f"{what} weight_scale")


# NOTE: on CPU tensors ``small_m_rows`` applies only under the Triton interpreter and with this
# set (a test of the routing): the interpreter in every engine test's decode step cost CI 60%
SMALL_M_INTERPRETED = False


class _Linear(nn.Module):
    """The weight (and, quantized, its per-channel scales) and the matmul both kinds share."""

    # NOTE: set by a model whose next kernel after this layer takes an ``UnscaledProduct`` (an
    # RMSNorm, SiLU-mul): an FP8 product taken with unit scales is returned with its scales
    # unapplied, and that kernel applies them. Never across ranks (a gather or a sum of products).
    defer_scales = False
    # NOTE: set by a model: up to this many rows a full-precision product without bias is
    # ``small_m_linear`` (split-K, merged in-kernel) instead of cuBLAS; 0: never
    small_m_rows = 0
    # NOTE: set by a model: an FP8 product without bias over up to ``small_m_rows`` rows is our
    # float8 split-K kernel (``fp8_small_m_linear``, both scales in its launch) instead of cuBLASLt's
    fp8_small_m = False

    def _create_weight(self, rows: int, cols: int, quantization: str | None) -> None:
        self.quantization = check_quantization(quantization)
        if quantization == "fp8":
            self.weight = new_param(rows, cols, weight_loader=self.weight_loader, dtype=FP8_DTYPE)
            self.weight_scale = new_param(rows, weight_loader=self.weight_loader, dtype=torch.float32)
        else:
            self.weight = new_param(rows, cols, weight_loader=self.weight_loader)
            self.weight_scale = None

    def _quantizes(self, param: torch.Tensor, src_dtype: torch.dtype) -> bool:
        """Whether ``param`` is a float8 weight that a full-precision checkpoint tensor fills."""
        return param is self.weight and self.weight_scale is not None and src_dtype != FP8_DTYPE

    def takes_small_m(self, x: torch.Tensor | Fp8Input | UnscaledProduct) -> bool:
        """Whether a product over ``x`` without bias runs our split-K kernel at ``small_m_rows``:
        ``small_m_linear`` (full precision; what ``matmul`` takes) or ``fp8_small_m_matmul``
        (float8 weights of cuBLASLt-sized shapes; what ``small_forward`` takes, with the norm
        after it folded in). Few enough rows, a GPU (or the routing test's interpreter)."""
        rows = x.q if isinstance(x, Fp8Input) else x.y if isinstance(x, UnscaledProduct) else x
        if self.weight_scale is not None and (self.weight.shape[0] % 16 or self.weight.shape[1] % 16):
            return False
        return (rows.dim() == 2 and rows.shape[0] <= self.small_m_rows
                and (rows.is_cuda or (SMALL_M_INTERPRETED and interpreting())))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            if bias is None and self.takes_small_m(x):
                return small_m_linear(x, self.weight)
            return F.linear(x, self.weight, bias)
        # NOTE: a row-parallel layer over several ranks takes its own FP8 path (RowParallelLinear.forward)
        if self.fp8_small_m and bias is None and self.takes_small_m(x):
            return fp8_small_m_linear(x, self.weight, self.weight_scale)
        defer = self.defer_scales and not getattr(self, "gather_output", False)
        return fp8_linear(x, self.weight, self.weight_scale, bias, defer_scales=defer)

    @property
    def folds(self) -> bool:
        """Whether ``small_forward`` serves this layer: a full-precision weight, no bias, no gather."""
        return self.weight_scale is None and self.bias is None and not getattr(self, "gather_output", False)

    def small_forward(self, x: torch.Tensor, **folding: Any) -> Any:
        """``forward`` for a few rows in one launch (this rank's columns or partial product),
        with ``small_m_linear``'s folding (the norm before or after it, SwiGLU after or before
        it); its torch reference where Triton cannot run."""
        if self.weight_scale is not None:
            return fp8_small_m_linear(x, self.weight, self.weight_scale, **folding)
        op = small_m_linear if x.is_cuda or interpreting() else small_m_linear_ref
        return op(x, self.weight, **folding)


class ColumnParallelLinear(_Linear):
    """``y = x A^T`` with A's rows (output features) split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 quantization: str | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.gather_output = gather_output
        self.output_size_per_rank = divide(output_size, self.tp_size, "output_size")
        self._create_weight(self.output_size_per_rank, input_size, quantization)
        self.bias = new_param(self.output_size_per_rank, weight_loader=self.weight_loader) if bias else None

    def shard_rows(self, shard_id: Any) -> tuple[int, int, str]:
        """``(offset in this rank's rows, rows, what)`` of a checkpoint tensor's shard."""
        return 0, self.output_size_per_rank, type(self).__name__

    def source_start(self, shard_id: Any, size: int) -> int:
        """The first checkpoint row of this rank's shard."""
        return self.tp_rank * size

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        offset, size, what = self.shard_rows(shard_id)
        start = self.source_start(shard_id, size)
        dst = param.data.narrow(0, offset, size)
        if param is self.weight_scale:
            load_scale(dst, loaded, start, size, what)
            return
        src = read_slice(loaded, 0, start, size)
        if self._quantizes(param, src.dtype):
            q, scale = quantize_rows(src.to(dst.device))
            copy_checked(dst, q, what)
            self.weight_scale.data.narrow(0, offset, size).copy_(scale)
        else:
            copy_checked(dst, src, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)  # (T, out / tp)
        return all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked on the output dim (gate and up projections).

    Each rank holds ``[gate shard; up shard]`` so ``silu_and_mul`` works on local halves.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quantization: str | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, quantization=quantization)
        for size in self.output_sizes:
            divide(size, self.tp_size, "merged output size")

    def shard_rows(self, shard_id: Any) -> tuple[int, int, str]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, size, f"merged shard {shard_id}"


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections with attention heads split across ranks.

    Query heads are split evenly. KV heads are split too when there are at least as many
    as ranks; with fewer (e.g. 8 KV heads at TP=16, or 1 at TP=2) each rank holds one KV
    head and groups of ``tp_size // total_num_kv_heads`` ranks share (replicate) it.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, quantization: str | None = None):
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
        super().__init__(hidden_size, output_size, bias, quantization=quantization)
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank

    def shard_rows(self, shard_id: Any) -> tuple[int, int, str]:
        if shard_id == "q":
            return 0, self.q_size, "q_proj"
        if shard_id in ("k", "v"):
            return self.q_size + (self.kv_size if shard_id == "v" else 0), self.kv_size, f"{shard_id}_proj"
        raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")

    def source_start(self, shard_id: Any, size: int) -> int:
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        return rank * size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_Linear):
    """``y = x A^T`` with A's columns (input features) split; partial sums all-reduced.

    The input arrives already split (the output of a column-parallel layer), so this is
    where the pair's one all-reduce happens.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 quantization: str | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.reduce_results = reduce_results
        self.input_size_per_rank = divide(input_size, self.tp_size, "input_size")
        self._create_weight(output_size, self.input_size_per_rank, quantization)
        self.bias = new_param(output_size) if bias else None  # replicated, added once

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        size, start = self.input_size_per_rank, self.tp_rank * self.input_size_per_rank
        if param is self.weight_scale:  # every output channel, whole
            load_scale(param.data, loaded, 0, param.shape[0], "RowParallelLinear")
            return
        full = read_all(loaded)
        if self._quantizes(param, full.dtype):
            # NOTE: the scale of the whole row, so the ranks' shards of one channel share it
            q, scale = quantize_rows(full.to(param.device))
            copy_checked(param.data, q.narrow(1, start, size), "RowParallelLinear")
            self.weight_scale.data.copy_(scale)
        else:
            copy_checked(param.data, read_slice(full, 1, start, size), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: only rank 0 adds the bias so that the sum over ranks counts it once.
        bias = self.bias if self.tp_rank == 0 else None
        if self.weight_scale is not None and self.tp_size > 1:
            # NOTE: each token's activation scale is taken over its whole row (a max over the
            # ranks, T floats), so TP=N quantizes exactly as one rank does.
            y = fp8_linear(x, self.weight, self.weight_scale, bias, amax_reduce=all_reduce_max)
        else:
            y = self.matmul(x, bias)  # (T, out), partial over ranks
        return all_reduce(y) if self.reduce_results else y

    def small_forward(self, x: torch.Tensor, **folding: Any) -> Any:
        """``forward`` for a few rows in one launch: this rank's partial product, summed. A norm
        after the product needs the whole sum: one rank only."""
        if self.reduce_results and self.tp_size > 1 and folding.get("norm_after") is not None:
            raise ValueError(f"norm_after needs the whole product; this layer's is summed over {self.tp_size} ranks")
        y = super().small_forward(x, **folding)
        return all_reduce(y) if self.reduce_results else y
