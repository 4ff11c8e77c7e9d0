"""Creating parameters and filling them from checkpoint tensors.

A checkpoint tensor reaches a ``weight_loader`` either as a ``torch.Tensor`` or as a
safetensors slice (``safe_open(...).get_slice(name)``); both index the same way, and a
slice reads only the indexed bytes from disk, so a rank reads only its shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[..., None]  # (param, loaded_weight, shard_id=None) -> None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in ``dtype`` inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def new_param(*shape: int, weight_loader: WeightLoader | None = None, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised inference parameter (default device; default dtype unless given) with its loader."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = weight_loader or default_weight_loader
    return param


def shape_of(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_slice(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, size)`` for a tensor or a safetensors slice."""
    index = [slice(None)] * len(shape_of(loaded))
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def read_all(loaded: Any) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[tuple(slice(None) for _ in shape_of(loaded))]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy ``src`` into ``dst`` (casting dtype), or raise naming the shapes."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Replicated parameter: every rank holds the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got shard_id={shard_id!r}")
    copy_checked(param.data, read_all(loaded), "replicated parameter")
