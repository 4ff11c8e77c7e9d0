"""SwiGLU's gate: ``silu(gate) * up`` over the two halves of the merged projection."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.fp8 import Fp8Input, UnscaledProduct
from sluiceway_kernels.silu_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref, silu_and_mul_ref


class SiluAndMul(nn.Module):
    """With ``quantize`` (before an FP8 down projection) the product comes as an ``Fp8Input``,
    quantized per token inside the same kernel."""

    def __init__(self, quantize: bool = False):
        super().__init__()
        self.quantize = quantize

    def forward(self, x: torch.Tensor | UnscaledProduct) -> torch.Tensor | Fp8Input:  # (T, 2I) -> (T, I)
        """``x`` may be the FP8 gate/up projection's ``UnscaledProduct``: the kernel applies its scales."""
        if self.quantize:
            op = silu_and_mul_fp8 if x.is_cuda else silu_and_mul_fp8_ref
            return Fp8Input(*op(x), x.dtype)
        if isinstance(x, UnscaledProduct):
            x = x.scaled()
        op = silu_and_mul if x.is_cuda else silu_and_mul_ref  # the Triton kernel or its torch reference
        return op(x)
