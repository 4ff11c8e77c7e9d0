"""Engine configuration: one validated object per concern, built from ``EngineArgs``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DEVICES = ("auto", "cuda", "cpu")
_PREEMPTION_MODES = ("auto", "swap", "recompute")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
ALL_REDUCES = ("nccl", "symmetric")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)  # and None


@dataclass
class EngineArgs:
    """Every argument of ``LLM(...)`` / ``LLMEngine``; vLLM's names and defaults."""

    model: str
    tokenizer: str | None = None  # defaults to the model's folder
    dtype: str = "auto"  # auto: the config's torch_dtype on GPU (bf16 if float32), float32 on CPU
    tensor_parallel_size: int = 1
    swap_space: float = 4.0  # GiB of CPU swap pool per GPU
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # token budget of one step; default below
    max_model_len: int | None = None  # defaults to the model's context length
    block_size: int = 16
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    seed: int = 0
    load_format: str = "auto"
    device: str = "auto"
    num_gpu_blocks_override: int | None = None
    preemption_mode: str = "auto"
    attention_backend: str = "auto"  # torch on CPU, triton on CUDA
    revision: str | None = None
    max_cpu_blocks_override: int | None = None  # caps the swap pool (tests)
    # launch each step before the previous one's tokens are read back (see LLMEngine.step);
    # None (the default) and True: on, False: off
    async_scheduling: bool | None = None
    # auto: the model's dtype; fp8 (= fp8_e4m3): keys and values stored as float8 e4m3 with
    # a scale of 1 (values beyond +-448 saturate), half the bytes of bf16
    kv_cache_dtype: str = "auto"
    # TP on GPUs: nccl, or symmetric: all-reduces up to 32 MiB as a two-shot all-reduce over
    # symmetric memory (half NCCL's time at decode sizes; opt-in, see docs/TENSOR_PARALLEL.md)
    all_reduce: str = "nccl"
    # None: the checkpoint's own (a pre-quantized FP8 checkpoint), else the model's dtype;
    # fp8: W8A8, weights float8 e4m3 with one scale per output channel (quantized at load
    # from full-precision checkpoints), activations quantized per token (engine/layers/fp8.py)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a path, hub id or built-in name, got {self.model!r}")
        _choice("dtype", self.dtype, _DTYPES)
        _choice("load_format", self.load_format, _LOAD_FORMATS)
        _choice("device", self.device, _DEVICES)
        _choice("preemption_mode", self.preemption_mode, _PREEMPTION_MODES)
        _choice("attention_backend", self.attention_backend, _ATTENTION_BACKENDS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("all_reduce", self.all_reduce, ALL_REDUCES)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size}")
        for name in ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.max_cpu_blocks_override is not None and self.max_cpu_blocks_override < 0:
            raise ValueError(f"max_cpu_blocks_override must be >= 0, got {self.max_cpu_blocks_override}")
        if isinstance(self.gpu_memory_utilization, bool) or not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.swap_space, bool) or float(self.swap_space) < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Build from keyword arguments; an unknown one raises ``ValueError`` naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(model=model, **kwargs)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
