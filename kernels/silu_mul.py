"""SwiGLU activation: silu(gate) * up over a fused gate|up projection."""

from __future__ import annotations

import torch

from kernels._common import FLOAT_DTYPES, check_same_device, check_tensor, next_pow2, tl, triton


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inner,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for x of shape (T, 2I); computed in fp32.

    Args:
        x: (T, 2I) float, last dim contiguous (rows may be strided).
        out: optional (T, I) of x's dtype, last dim contiguous.

    Returns: ``out``, (T, I).
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got {width}")
    inner = width // 2
    if out is None:
        out = torch.empty((num_rows, inner), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, 2, (x.dtype,))
        if tuple(out.shape) != (num_rows, inner):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {(num_rows, inner)}")
    check_same_device(x=x, out=out)
    if num_rows and inner:
        block = min(1024, next_pow2(inner))
        grid = (num_rows, -(-inner // block))
        _silu_and_mul_kernel[grid](
            x, out, x.stride(0), out.stride(0), inner, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch :func:`silu_and_mul`."""
    inner = x.shape[-1] // 2
    result = (torch.nn.functional.silu(x[..., :inner].float()) * x[..., inner:].float()).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
