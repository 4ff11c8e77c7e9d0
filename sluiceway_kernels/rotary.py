"""Rotary position embedding applied in place to queries and keys."""

from __future__ import annotations

import torch

from sluiceway_kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    next_pow2,
    tl,
    triton,
)


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin, half,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (pairs[None, :] < half)
    if IS_NEOX:  # pair i with i + half
        first = heads[:, None] * stride_h + pairs[None, :]
        second = first + half
    else:  # pair 2i with 2i + 1
        first = heads[:, None] * stride_h + 2 * pairs[None, :]
        second = first + 1
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + second, mask=mask, other=0.0).to(tl.float32)
    # NOTE: explicit fmas, so every kernel that rotates rounds alike: left to the compiler, the
    # contraction of a*b - c*d picks either product per kernel (rope_store's k differed by an ulp)
    tl.store(x_ptr + first, tl.fma(x1, cos, -(x2 * sin)).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + second, tl.fma(x2, cos, x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads, half,
    IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cache + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + half + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos[None, :], sin[None, :], half,
                  IS_NEOX, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, cos[None, :], sin[None, :], half,
                  IS_NEOX, BLOCK_HK, BLOCK_HALF)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotate q and k in place by their tokens' positions.

    Args:
        q: (T, Hq, D), k: (T, Hkv, D); same float dtype; token and head dims may be strided
            (views of a fused qkv output), D contiguous.
        positions: (T,) int32/int64 absolute positions, each < max_pos.
        cos_sin_cache: (max_pos, R), R even and <= D: cos in the first R/2 columns, sin in
            the last R/2 (fp32 recommended). Only the first R dims of each head rotate.
        is_neox: True pairs dim i with i + R/2 (HF Llama/Qwen "rotate_half"); False pairs
            2i with 2i+1 (GPT-J).

    Computes in fp32 and rounds once to the model dtype. No host synchronisation.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    rot = cos_sin_cache.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in tokens/head_dim")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype} vs {k.dtype}")
    check_shape("positions", positions, (num_tokens,))
    if rot % 2 or rot > head_dim or rot == 0:
        raise ValueError(f"cos_sin_cache width {rot} must be even, positive and <= head_dim {head_dim}")
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    if num_tokens == 0:
        return
    half = rot // 2
    block_half = next_pow2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1], half,
        IS_NEOX=bool(is_neox), BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_HALF=block_half, num_warps=4 if next_pow2(num_q_heads) * block_half >= 1024 else 1,
    )


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Plain-torch :func:`apply_rotary`, same arguments, same in-place effect."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # (T, R)
    cos = cos_sin[:, None, :half]  # (T, 1, R/2)
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        part = x[..., :rot].float()  # (T, H, R)
        if is_neox:
            x1, x2 = part[..., :half], part[..., half:]
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x[..., :rot] = rotated.to(x.dtype)


def make_cos_sin_cache(
    max_positions: int, rotary_dim: int, base: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """The plain RoPE table, (max_positions, rotary_dim) fp32: cos | sin of pos * base^(-2i/R)."""
    inv_freq = base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()
