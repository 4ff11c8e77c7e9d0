"""SwiGLU's gate: ``silu(gate) * up`` over the two halves of the merged projection."""

from __future__ import annotations

import torch
from torch import nn

from kernels.silu_mul import silu_and_mul, silu_and_mul_ref


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
        op = silu_and_mul if x.is_cuda else silu_and_mul_ref  # the Triton kernel or its torch reference
        return op(x)
