"""Per-layer K/V cache scales read from FP8 checkpoints that carry them.

A float8 KV cache holds ``K / k_scale`` and ``V / v_scale``; the attention kernels multiply
them back. Exports name the scales of layer N's attention in several ways, all under
``model.layers.N.self_attn.``:

- ``k_scale``, ``v_scale``: vLLM's and llm-compressor's (compressed-tensors ``kv_cache_scheme``);
- ``kv_scale``: the older single scale, used for both;
- ``k_proj.output_scale``, ``v_proj.output_scale``: older compressed-tensors exports;
- ``k_proj.k_scale``, ``v_proj.v_scale``: NVIDIA ModelOpt's;
- ``attn.k_scale``, ``attn.v_scale``: a state dict written from vLLM's own modules.

Each is one float32 value (shape () or (1,)), finite and positive. They are used when the
cache is float8 (``kv_cache_dtype="fp8"``); otherwise they are read, checked and ignored,
with one log line.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

# suffix after "self_attn." -> which scales it sets
_SCALE_NAMES = {
    "k_scale": "k", "v_scale": "v", "kv_scale": "kv",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",
    "attn.k_scale": "k", "attn.v_scale": "v",
}
# NOTE: scales of a float8 query or of the attention probabilities (FP8 attention) are read
# past: queries and probabilities stay in the model's dtype here.
_IGNORED_NAMES = ("q_scale", "prob_scale", "q_proj.output_scale", "attn.q_scale", "attn.prob_scale")


def _split(name: str) -> tuple[str, str] | None:
    """``model.layers.3.self_attn.k_scale`` -> (``model.layers.3.self_attn``, ``k_scale``)."""
    prefix, sep, suffix = name.rpartition("self_attn.")
    if not sep or (prefix and not prefix.endswith(".")):
        return None
    return prefix + "self_attn", suffix


def is_kv_scale(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` is a K/V cache scale (or one read past)."""
    parts = _split(name)
    return parts is not None and (parts[1] in _SCALE_NAMES or parts[1] in _IGNORED_NAMES)


@dataclass
class KVScales:
    """The K/V scales found in a checkpoint, per attention module name."""

    found: dict[str, dict[str, float]] = field(default_factory=dict)  # "...self_attn.attn" -> {"k": s, "v": s}

    def read(self, name: str, tensor: torch.Tensor) -> None:
        """Record the checkpoint tensor ``name`` (``is_kv_scale(name)`` is true); raises
        ``ValueError`` naming it if it is not one finite, positive value."""
        prefix, suffix = _split(name)
        which = _SCALE_NAMES.get(suffix)
        if which is None:
            return  # a query / probability scale: read past
        if tensor.numel() != 1 or tensor.dim() > 1:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; a K/V cache scale must be "
                             "one value (shape () or (1,)): per-head scales are not supported")
        value = float(tensor.float().reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"checkpoint tensor {name!r} is {value}; a K/V cache scale must be finite and > 0")
        scales = self.found.setdefault(prefix + ".attn", {})
        for key in which:
            scales[key] = value

    def apply(self, model: nn.Module, kv_cache_dtype: torch.dtype | None) -> None:
        """Give each attention layer its scales when the cache is float8; else log that they are ignored.

        A layer with only one of the two keeps a scale of 1 for the other.
        """
        if not self.found:
            return
        from sluiceway_kernels._common import FP8_KV_DTYPE

        if kv_cache_dtype != FP8_KV_DTYPE:
            # NOTE: kv_cache_dtype="auto" keeps the model's dtype even when the checkpoint was
            # calibrated for a float8 cache (compressed-tensors' kv_cache_scheme): the cache's
            # size and numbers change only when asked for, as in vLLM.
            logger.info("the checkpoint carries K/V cache scales for %d attention layers; they are ignored, as the "
                        "KV cache is %s (kv_cache_dtype='fp8' uses them)", len(self.found), kv_cache_dtype)
            return
        modules = dict(model.named_modules())
        for name, scales in self.found.items():
            attn = modules.get(name)
            if attn is None or not hasattr(attn, "set_kv_scales"):
                raise ValueError(f"checkpoint has K/V cache scales for {name.removesuffix('.attn')!r}, which is not "
                                 f"an attention layer of {type(model).__name__}")
            attn.set_kv_scales(scales.get("k", 1.0), scales.get("v", 1.0))
