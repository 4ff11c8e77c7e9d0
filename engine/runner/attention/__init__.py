"""Attention backends over the paged KV cache: plain torch (CPU, reference) and Triton (GPU)."""

from __future__ import annotations

import torch

from engine.runner.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "get_attention_backend"]

_BACKENDS = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: str | torch.device) -> AttentionBackend:
    """``name``: auto (triton on CUDA, torch elsewhere), torch or triton."""
    device = torch.device(device)
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(_BACKENDS)}; got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from engine.runner.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from sluiceway_kernels._common import interpreting, triton_available

    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device (got {device}); use 'torch' on CPU, "
            "or set TRITON_INTERPRET=1 to run the kernels through the interpreter"
        )
    if not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package, which is not installed")
    from engine.runner.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
