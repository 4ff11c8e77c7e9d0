"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.params import new_param
from kernels.rms_norm import rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        op = rms_norm if x.is_cuda else rms_norm_ref  # same contract: the Triton kernel or its torch reference
        return op(x, self.weight, self.eps, residual)
