"""Everything decided about the model before any weights load: config, dtype, device, sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineArgs
from engine.distributed import SYMMETRIC_MAX_BYTES

_DEFAULT_BUDGET = 8192


@dataclass
class ModelInfo:
    model: str  # what to load: a local folder or a preset name
    path: Path | None  # the checkpoint folder (None for presets)
    hf_config: Any
    load_format: str
    dtype: torch.dtype
    kv_dtype: torch.dtype  # what the KV cache holds: dtype, or float8 e4m3
    device: torch.device
    attention_backend: str
    seed: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    swap_bytes: int  # per rank
    max_cpu_blocks: int | None
    tensor_parallel_size: int
    num_layers: int
    num_kv_heads_per_rank: int
    head_dim: int
    enforce_eager: bool = False  # no CUDA graphs for decode batches
    all_reduce: str = "nccl"  # TP on GPUs: nccl, or symmetric for small all-reduces
    quantization: str | None = None  # fp8: W8A8 float8 linear layers (resolved: the checkpoint's or asked)

    def symmetric_all_reduce(self) -> tuple[torch.dtype, int] | None:
        """``init_tensor_parallel``'s argument: the activations' dtype and the bytes of the
        largest all-reduce worth staging (one step's tokens x hidden, capped)."""
        if self.all_reduce != "symmetric" or self.device.type != "cuda" or self.tensor_parallel_size == 1:
            return None
        step_bytes = self.max_num_batched_tokens * self.hf_config.hidden_size * _itemsize(self.dtype)
        return self.dtype, min(SYMMETRIC_MAX_BYTES, step_bytes)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on one rank."""
        return 2 * self.num_layers * self.num_kv_heads_per_rank * self.head_dim * _itemsize(self.kv_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def resolve_model_info(args: EngineArgs) -> ModelInfo:
    from engine.model_loader import (is_preset, load_hf_config, resolve_device, resolve_dtype, resolve_model_path,
                                     resolve_quantization)

    device = resolve_device(args.device)
    if is_preset(args.model) and not Path(args.model).is_dir():
        if args.load_format != "dummy":
            raise ValueError(
                f"model: {args.model!r} is a built-in architecture without weights; pass load_format='dummy'"
            )
        path, model = None, args.model
    else:
        path = resolve_model_path(args.model, args.revision)
        model = str(path)
    hf_config = load_hf_config(model, args.revision)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype, device)
    quantization = resolve_quantization(args.quantization, hf_config, device)

    context = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    max_model_len = args.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context length ({context})")
    budget = args.max_num_batched_tokens or max(_DEFAULT_BUDGET, 0)
    if budget < args.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({args.max_num_seqs})"
        )

    tp = args.tensor_parallel_size
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide the model's {num_heads} attention heads"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp}) and the model's {num_kv_heads} KV heads must divide one another"
        )
    if device.type == "cuda" and tp > torch.cuda.device_count():
        visible = torch.cuda.device_count()
        raise ValueError(
            f"tensor_parallel_size ({tp}) needs {tp} CUDA devices, but {visible} "
            f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); lower tensor_parallel_size"
        )
    swap_bytes = int(float(args.swap_space) * (1 << 30))
    return ModelInfo(
        model=model, path=path, hf_config=hf_config, load_format=args.load_format, dtype=dtype, kv_dtype=kv_dtype,
        device=device, attention_backend=args.attention_backend, seed=args.seed,
        max_model_len=max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_bytes=swap_bytes, max_cpu_blocks=args.max_cpu_blocks_override, tensor_parallel_size=tp,
        num_layers=hf_config.num_hidden_layers, num_kv_heads_per_rank=max(1, num_kv_heads // tp),
        head_dim=head_dim, enforce_eager=bool(args.enforce_eager),
        all_reduce=args.all_reduce, quantization=quantization,
    )


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's (``auto``) or float8 e4m3 (``fp8``, ``fp8_e4m3``)."""
    if kv_cache_dtype == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {major}.{minor}: use kv_cache_dtype='auto'"
        )
    from kernels._common import FP8_KV_DTYPE

    return FP8_KV_DTYPE
