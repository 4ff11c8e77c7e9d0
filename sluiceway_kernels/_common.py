"""Shared launcher plumbing: the Triton import guard and argument checks."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # a CPU-only install without triton: references still work
    HAS_TRITON = False

    class _Constexpr:
        pass

    class _MissingLanguage:
        constexpr = _Constexpr

    class _MissingTriton:
        @staticmethod
        def jit(fn=None, **_kwargs):
            def wrap(f):
                return _unavailable_kernel(f.__name__)

            return wrap(fn) if fn is not None else wrap

    def _unavailable_kernel(name: str):
        class _Unavailable:
            def __getitem__(self, _grid):
                raise RuntimeError(f"kernel {name} needs triton, which is not installed")

        return _Unavailable()

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingLanguage()  # type: ignore[assignment]

try:  # grid dependency control (programmatic dependent launch), triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False

__all__ = ["triton", "tl", "HAS_TRITON", "triton_available", "interpreting", "next_pow2", "pdl_options",
           "wait_for_previous"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# a float dtype as a kernel's constexpr (the dtype a kernel rounds to when no pointer of it is at hand)
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16} if HAS_TRITON else {}
FP8_KV_DTYPE = torch.float8_e4m3fn  # a float8 KV cache: value / scale, saturating beyond +-FP8_KV_MAX
FP8_KV_MAX = 448.0
KV_DTYPES = (*FLOAT_DTYPES, FP8_KV_DTYPE)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True when the Triton kernels can run here: on a CUDA GPU, or on CPU under the interpreter."""
    return HAS_TRITON and (torch.cuda.is_available() or interpreting())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the CPU interpreter): sizes split grids."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# NOTE: programmatic dependent launch (Hopper and later). A kernel launched with it may be
# scheduled while the kernel before it in the stream is still running; each of its programs
# first waits for that kernel to complete and its writes to land (``wait_for_previous``), then
# lets the kernel after it be scheduled the same way. A batch-1 decode step is a chain of ~280
# short kernels, each of which otherwise starts only after the one before it has drained. The
# kernels that take it: those a decode step runs (rms_norm, small_m_linear and fp8_small_m, the
# decode attention, silu_and_mul, argmax_logsumexp, the float8 quantization and scale epilogue).
# Measured on an H100 (docs/BENCHMARKS.md, sessions 31-32): batch 1 0.5-1.8% faster (bf16 6.02
# against 6.05 ms, FP8 4.29 against 4.37), the throughput workload unchanged (bf16 10,118 against
# 10,088 tok/s; FP8 14,407 / 14,305 against 14,403 / 14,303).
PDL = True


def pdl_options(device: torch.device) -> dict:
    """The launch options of a kernel that starts with ``wait_for_previous(PDL)``: its ``PDL``
    constexpr, and triton's ``launch_pdl`` where the launch takes it (``PDL`` on, a CUDA device
    of compute capability 9.0 or later, compiled rather than interpreted)."""
    if not (PDL and HAS_GDC and device.type == "cuda" and not interpreting() and _capability(device) >= (9, 0)):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_previous(PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """A kernel's first statement: with PDL, wait until the kernel before it in the stream has
    completed (its writes visible), then let the next kernel be scheduled (RELEASE; else the
    kernel calls ``release_dependents`` later). Every program runs it before touching memory
    that an earlier kernel writes, so a kernel launched early still completes after the one
    before it."""
    if PDL:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """With PDL, let the next kernel be scheduled now (after ``wait_for_previous(PDL, False)``).

    NOTE: released at the start, a grid of more programs than fit on the GPU at once shares
    its later waves' SMs with the next kernel's programs, which only wait; released after its
    main loop, the next kernel overlaps just the epilogue."""
    if PDL:
        gdc_launch_dependents()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_options(q_dtype: torch.dtype, cache_dtype: torch.dtype, interpreted: bool | None = None) -> dict:
    """The attention kernels' DOT_UPCAST, DOT_HALF and DOT_PRECISION for these dtypes.

    ``interpreted``: pick them as the interpreter (True) or a GPU (False) runs the kernels;
    default: as this process does.

    NOTE: the interpreter multiplies the raw bits of bfloat16 operands in tl.dot, so under it
    bf16 tiles are widened to fp32 before each dot (DOT_UPCAST); compiled kernels keep bf16.
    Over a float8 cache, compiled bf16 queries take their dots in fp16 (DOT_HALF): float8
    e4m3 widens to fp16 in one native conversion per pair, against a longer route to bf16
    on Hopper; fp16 holds every e4m3 value and every bf16 query element between 2^-14 and
    65504 exactly, and the softmax weights more finely than bf16. A query element beyond
    65504 would overflow to inf; no model we run comes near it. fp32 models ask for exact
    fp32 products (no TF32); half types ignore DOT_PRECISION.
    """
    interpreted = interpreting() if interpreted is None else interpreted
    upcast = interpreted and q_dtype == torch.bfloat16
    return dict(
        DOT_UPCAST=upcast,
        DOT_HALF=cache_dtype == FP8_KV_DTYPE and q_dtype == torch.bfloat16 and not upcast,
        DOT_PRECISION="ieee" if q_dtype == torch.float32 else "tf32",
    )


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Iterable[torch.dtype],
) -> torch.Tensor:
    """Type, rank and dtype of one argument; the kernels also need a unit stride in the last dim.

    NOTE: every launcher runs these on every call, a few dozen a layer on the eager path whose
    launches bound a prompt step: the common case takes the cheapest checks first.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {names}")
    if ndim and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    values = iter(tensors.values())
    first = next(values).device
    for t in values:
        if t.device != first:
            devices = {name: t.device for name, t in tensors.items()}
            raise ValueError(f"all tensors must be on one device, got {devices}")
    if first.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {first}); on CPU use the *_ref functions "
            "or set TRITON_INTERPRET=1"
        )
    return first


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(expected)}")


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Checks shared by the paged attention launchers: q (N, Hq, D) against the two caches."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    check_tensor("v_cache", v_cache, 4, KV_DTYPES)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_shape("v_cache", v_cache, k_cache.shape)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(
            f"k_cache and v_cache must both have q's dtype or both be {FP8_KV_DTYPE}: "
            f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if block_size & (block_size - 1) or block_size > 256:
        raise ValueError(f"block_size must be a power of two up to 256, got {block_size}")


def check_kv_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, cache_dtype: torch.dtype) -> bool:
    """The per-layer K/V scales of a float8 cache: both None (a scale of 1) or both one-element
    float32 tensors (shape () or (1,)), on the cache's device. Returns whether they are given.

    NOTE: the scales travel as device tensors, not floats: the kernels read them on the device,
    so a CUDA graph captured over them stays valid (the tensors stay put, one per layer), no
    host sync reads a value, and every layer runs the same compiled kernel.
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"k_scale and v_scale go together; got k_scale={_kind(k_scale)}, v_scale={_kind(v_scale)}")
    if k_scale is None:
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32 or t.numel() != 1 or t.dim() > 1:
            raise ValueError(f"{name} must be one float32 value of shape () or (1,); got {t.dtype} {tuple(t.shape)}")
    if cache_dtype != FP8_KV_DTYPE:
        raise ValueError(f"k_scale/v_scale apply to a {FP8_KV_DTYPE} cache only; the cache is {cache_dtype}")
    return True


def _kind(t: object) -> str:
    return "None" if t is None else type(t).__name__


MIN_COUNTERS = 4096  # arrival counters allocated at least (decode: sequences x kv heads that split)


def split_counters(device: torch.device, n: int, name: str = "decode") -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` arrival counters (decode: one per sequence and
    kv head), one buffer per kernel ``name`` and device.

    The kernel returns every counter it uses to zero, so one buffer serves every launch,
    CUDA-graph replays included; it is allocated on the first call, outside any capture (the
    engine's warm-up pass runs before each capture).
    """
    key = (name, device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"paged decode attention needs {n} split counters during a CUDA-graph capture but has "
                f"{0 if buf is None else buf.numel()}: run the same batch once before capturing"
            )
        buf = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


_COUNTERS: dict[tuple[str, str, int | None], torch.Tensor] = {}
