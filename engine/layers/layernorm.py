"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.fp8 import Fp8Input, UnscaledProduct
from engine.layers.params import new_param
from sluiceway_kernels.rms_norm import rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (norm(x + residual), x + residual).

    With ``quantize`` (the norm before an FP8 linear layer) the normed x comes as an
    ``Fp8Input``, quantized per token inside the same kernel.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, quantize: bool = False):
        super().__init__()
        self.eps = eps
        self.quantize = quantize
        self.weight = new_param(hidden_size)

    def forward(
        self, x: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Input | tuple[torch.Tensor | Fp8Input, torch.Tensor]:
        """``x`` may be an FP8 projection's ``UnscaledProduct``: the kernel applies its scales."""
        op = rms_norm if x.is_cuda else rms_norm_ref  # same contract: the Triton kernel or its torch reference
        out = op(x, self.weight, self.eps, residual, quantize=self.quantize)
        if not self.quantize:
            return out
        normed, new_residual = out if residual is not None else (out, None)
        normed = Fp8Input(*normed, x.dtype)
        return normed if residual is None else (normed, new_residual)
