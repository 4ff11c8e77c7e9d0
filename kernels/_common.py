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

__all__ = ["triton", "tl", "HAS_TRITON", "triton_available", "interpreting", "next_pow2"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # a float8 KV cache: scale 1, values beyond +-FP8_KV_MAX saturate
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
    """Type, rank and dtype of one argument; the kernels also need a unit stride in the last dim."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {names}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
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
