"""Engine configuration: the flat ``EngineArgs`` (vLLM's flags) and one validated config per
concern built from them, bundled with the model's ``ModelShape`` in an ``EngineConfig``
(``engine.models.resolve.create_engine_config``). Torch-free (the core imports ``SchedulerConfig``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.models.shape import ModelShape

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DEVICES = ("auto", "cuda", "cpu")
_PREEMPTION_MODES = ("auto", "swap", "recompute")
SCHEDULING_POLICIES = ("priority", "fcfs")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
ALL_REDUCES = ("nccl", "symmetric")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)  # and None
# NOTE: past a few thousand tokens a step's GEMMs take far longer than its launches, so
# capturing it saves nothing and costs graph memory
MAX_PREFILL_GRAPH_TOKENS = 8192
# 26.9 -> 7.5 ms TTFT at batch 1 on an H100 (docs/BENCHMARKS.md, 2026-12-06)
DEFAULT_PREFILL_GRAPH_TOKENS = 512


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
    # prompt-carrying steps of up to this many tokens replay CUDA graphs (prompts alone: the whole
    # forward; with decodes: everything but attention, engine/runner/prefill_graphs.py); 0: they
    # run eagerly. None: DEFAULT_PREFILL_GRAPH_TOKENS on one GPU, eager under tensor parallelism
    # (not yet run on several GPUs)
    prefill_graph_tokens: int | None = None
    # steps of up to 8 tokens (decode batches of 1-8) run each decoder layer in five kernels, the
    # norms and SwiGLU folded into our own small-batch matmuls (sluiceway_kernels/small_m_linear.py)
    # rather than cuBLAS's; full-precision weights without biases only. Opt-in: 1.8x slower per
    # token than cuBLAS's layer on an H100 (docs/BENCHMARKS.md, 2026-12-06)
    small_batch_kernels: bool = False
    # the express lane (docs/SWAP.md): a waiting prompt of up to this many tokens that outranks
    # running work runs at once, in a CUDA graph of its own on a high-priority stream beside the
    # step in flight, instead of after it; the scheduler keeps two such prompts' blocks free of
    # lower-ranked admissions for it. Needs one GPU, async scheduling, the priority policy and a
    # caller that waits in ``step(before_schedule=...)`` (the worker's late admission). 0: off
    express_lane_tokens: int = 0
    seed: int | None = 0  # None: the default, 0, as vLLM's V1 engine takes it
    load_format: str = "auto"
    device: str = "auto"
    num_gpu_blocks_override: int | None = None
    preemption_mode: str = "auto"
    # priority: higher ``priority`` first (ours; vLLM's is lower first), and a waiting or
    # swapped request that outranks running ones preempts them (docs/SWAP.md); fcfs: arrival
    # order, priorities ignored, no preemption for rank (vLLM's default)
    scheduling_policy: str = "priority"
    attention_backend: str = "auto"  # torch on CPU, triton on CUDA
    revision: str | None = None
    # launch each step before the previous one's tokens are read back (see LLMEngine.step);
    # steps whose sampling reads every earlier token (penalties) still run synchronously
    async_scheduling: bool = True
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
    max_logprobs: int = 20  # the most logprobs a request may ask for (SamplingParams caps it at 20 too)
    # sampling defaults for a request given no SamplingParams: "auto" reads the model's
    # generation_config.json, "vllm" uses SamplingParams' own, or a folder holding that file
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None  # laid over those defaults
    # a structured-output constraint whose grammar takes longer to compile fails its request
    structured_outputs_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a path, hub id or built-in name, got {self.model!r}")
        _choice("dtype", self.dtype, _DTYPES)
        _choice("load_format", self.load_format, _LOAD_FORMATS)
        _choice("device", self.device, _DEVICES)
        _choice("attention_backend", self.attention_backend, _ATTENTION_BACKENDS)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}, "
                             "which is not supported (None reads a pre-quantized FP8 checkpoint as it is)")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r}")
        timeout = self.structured_outputs_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_timeout_s must be a positive number of seconds, got {timeout!r}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if not isinstance(self.small_batch_kernels, bool):
            raise ValueError(f"small_batch_kernels must be true or false, got {self.small_batch_kernels!r}")
        tokens = self.prefill_graph_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                   or not 0 <= tokens <= MAX_PREFILL_GRAPH_TOKENS):
            raise ValueError(f"prefill_graph_tokens must be an integer from 0 (off) to {MAX_PREFILL_GRAPH_TOKENS}, "
                             f"got {tokens!r}")
        if self.seed is None:
            self.seed = 0
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        express = self.express_lane_tokens
        if isinstance(express, bool) or not isinstance(express, int) or not 0 <= express <= MAX_PREFILL_GRAPH_TOKENS:
            raise ValueError(f"express_lane_tokens must be an integer from 0 (off) to {MAX_PREFILL_GRAPH_TOKENS}, "
                             f"got {express!r}")
        if express and self.tensor_parallel_size != 1:
            raise ValueError(f"express_lane_tokens needs tensor_parallel_size 1 (got {self.tensor_parallel_size}): "
                             "the ranks' collectives cannot run on two streams at once")
        if express and (not self.async_scheduling or self.scheduling_policy != "priority"):
            raise ValueError("express_lane_tokens needs async_scheduling and scheduling_policy='priority': it runs "
                             "work that outranks the step in flight beside it")
        # NOTE: the flags of the other concerns are checked by their configs, built here too so
        # that a bad flag fails before anything loads (the worker's command line relies on it);
        # the context is the model's, unknown yet: the scheduler's checks do not depend on it.
        self.cache_config()
        self.parallel_config()
        self.scheduler_config(self.max_model_len or SchedulerConfig.max_model_len)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Build from keyword arguments; an unknown one raises ``ValueError`` naming it.

        vLLM arguments that change nothing here are accepted and logged once
        (``engine.vllm_args``); one whose value would need a missing feature raises."""
        from engine.vllm_args import IGNORED, drop_ignored

        known = {f.name for f in dataclasses.fields(cls)} | set(IGNORED)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(model=model, **drop_ignored(kwargs))

    def resolved_prefill_graph_tokens(self) -> int:
        if self.prefill_graph_tokens is not None:
            return self.prefill_graph_tokens
        return DEFAULT_PREFILL_GRAPH_TOKENS if self.tensor_parallel_size == 1 else 0

    def cache_config(self) -> "CacheConfig":
        return pick_fields(CacheConfig, self)

    def parallel_config(self) -> "ParallelConfig":
        return pick_fields(ParallelConfig, self)

    def scheduler_config(self, max_model_len: int) -> "SchedulerConfig":
        budget = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        return pick_fields(SchedulerConfig, self, max_num_batched_tokens=budget, max_model_len=max_model_len)


@dataclass(frozen=True)
class ModelConfig:
    """What runs: the checkpoint, its HF config, dtype, device, context and how to execute it."""

    model: str  # what to load: a local folder or a preset name
    path: Path | None  # the checkpoint folder (None for presets)
    hf_config: Any
    dtype: "torch.dtype"
    device: "torch.device"
    max_model_len: int
    tokenizer: str | None = None  # a tokenizer folder other than the checkpoint's
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    prefill_graph_tokens: int = 0  # the largest prompt-carrying step replayed as piecewise graphs
    small_batch_kernels: bool = False  # steps of up to 8 tokens: five kernels a layer
    quantization: str | None = None  # fp8: W8A8 float8 linear layers (resolved: the checkpoint's or asked)

    def __post_init__(self) -> None:
        context = context_length(self.hf_config)
        if self.max_model_len > context:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context length ({context})")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, device and swap-pool sizes, the cache dtype, prefix caching."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of CPU swap pool per rank
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size}")
        if isinstance(self.gpu_memory_utilization, bool) or not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.swap_space, bool) or float(self.swap_space) < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.num_gpu_blocks_override is not None:
            _positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)

    @property
    def swap_bytes(self) -> int:
        """The swap pool's bytes per rank."""
        return int(float(self.swap_space) * (1 << 30))


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks, and which all-reduce they use on GPUs."""

    tensor_parallel_size: int = 1
    all_reduce: str = "nccl"  # nccl, or symmetric for small all-reduces (opt-in)

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _choice("all_reduce", self.all_reduce, ALL_REDUCES)


@dataclass(frozen=True)
class SchedulerConfig:
    """One step's budgets, the context limit, the preemption mode and async scheduling."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 4096
    preemption_mode: str = "auto"  # swap | recompute | auto
    async_scheduling: bool = True
    scheduling_policy: str = "priority"  # priority | fcfs (docs/SWAP.md)
    # NOTE: starvation and thrash bounds of rank preemption (docs/SWAP.md), not engine
    # arguments: the defaults were chosen for interactive-over-bulk traffic.
    aging_steps: int = 128  # steps passed over by higher-rank work after which a sequence goes first
    min_resident_steps: int = 32  # steps a sequence that got a seat is safe from preemption for rank
    express_lane_tokens: int = 0  # EngineArgs.express_lane_tokens

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive_int(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        _choice("preemption_mode", self.preemption_mode, _PREEMPTION_MODES)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        for name in ("aging_steps", "min_resident_steps"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")


@dataclass
class EngineConfig:
    """The four configs of one engine and the model's shape on its ranks (shipped to every rank)."""

    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    kv_dtype: "torch.dtype"  # what the KV cache holds: the model's dtype, or float8 e4m3
    shape: ModelShape = field(init=False)

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        self.shape = ModelShape.from_hf_config(self.model.hf_config, tp)
        heads, kv_heads = self.shape.num_heads, self.shape.num_kv_heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {heads} attention heads")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) and the model's {kv_heads} KV heads must divide one another")
        visible = _cuda_device_count() if self.model.device.type == "cuda" else tp
        if tp > visible:
            raise ValueError(
                f"tensor_parallel_size ({tp}) needs {tp} CUDA devices, but {visible} {'is' if visible == 1 else 'are'}"
                f" visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); lower "
                "tensor_parallel_size"
            )

    @property
    def kv_bytes_per_block(self) -> int:
        """KV bytes one block takes on one rank."""
        return self.shape.kv_bytes_per_token(self.kv_dtype.itemsize) * self.cache.block_size

    def symmetric_all_reduce(self) -> "tuple[torch.dtype, int] | None":
        """``init_tensor_parallel``'s argument: the activations' dtype and the bytes of the
        largest all-reduce worth staging (one step's tokens x hidden, capped)."""
        from engine.executor.distributed import SYMMETRIC_MAX_BYTES

        if (self.parallel.all_reduce != "symmetric" or self.model.device.type != "cuda"
                or self.parallel.tensor_parallel_size == 1):
            return None
        dtype = self.model.dtype
        step_bytes = self.scheduler.max_num_batched_tokens * self.shape.hidden_size * dtype.itemsize
        return dtype, min(SYMMETRIC_MAX_BYTES, step_bytes)


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def context_length(hf_config: Any) -> int:
    """The longest sequence the model was built for."""
    return int(getattr(hf_config, "max_position_embeddings", 0) or 2048)


def pick_fields(cls: type, args: EngineArgs, **values: Any) -> Any:
    """``cls`` built from the ``EngineArgs`` fields of the same names (``values`` win; a field
    ``EngineArgs`` lacks keeps ``cls``'s default)."""
    names = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(EngineArgs)} - set(values)
    return cls(**{name: getattr(args, name) for name in names}, **values)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
