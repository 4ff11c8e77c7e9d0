"""Rotary position embedding (neox style: the head dim's two halves rotate as pairs)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sluiceway_kernels.rotary import apply_rotary, apply_rotary_ref

_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """``(theta, scaling)`` from an HF config, old (``rope_theta`` + ``rope_scaling``) or
    new (``rope_parameters``) layout; ``scaling`` is ``{}`` for plain RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, ({} if rope_type == "default" else dict(params, rope_type=rope_type))


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """(D/2,) float32 rotation speeds, after any context-extension scaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than the original context are slowed by `factor`, shorter
    # than original / high_freq_factor are kept, and the band between is interpolated.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq  # (D/2,)
    slowed = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)  # (D/2,)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(nn.Module):
    """Holds the (max_position, D) float32 cache: cos in the first half, sin in the second."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling or {})  # (D/2,)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)

    @classmethod
    def from_config(cls, config: Any, head_dim: int) -> "RotaryEmbedding":
        theta, scaling = rope_settings(config)
        return cls(head_dim, config.max_position_embeddings, theta, scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (T, Hq, D) and k (T, Hkv, D) in place at ``positions`` (T,)."""
        op = apply_rotary if q.is_cuda else apply_rotary_ref
        op(q, k, positions, self.cos_sin_cache, is_neox=True)
        return q, k
