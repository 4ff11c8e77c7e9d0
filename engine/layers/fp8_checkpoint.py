"""Pre-quantized FP8 checkpoints: reading ``quantization_config`` from config.json.

Two formats users download are read:

- ``quant_method: "fp8"`` (vLLM's and many hub exports): float8 e4m3 weights with one
  ``weight_scale`` per tensor, optionally an ``input_scale`` per tensor (static activations).
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's
  FP8 and FP8_DYNAMIC schemes): float8 weights with ``weight_scale`` per channel ((N, 1)) or
  per tensor, activations dynamic per token or static per tensor (``input_scale``).

Both run through the same layers as ``quantization="fp8"``: a per-tensor scale is spread
over its rows, so q, k and v (or gate and up) keep their own scales inside the fused matrix.
Either may carry per-layer K/V cache scales (compressed-tensors says so in
``kv_cache_scheme``), which a float8 KV cache uses (``engine.layers.kv_scales``).
"""

from __future__ import annotations

from typing import Any

# NOTE: static activation scales (``input_scale``) are not applied: activations are always
# quantized per token as they arrive, which is at least as fine as one scale per tensor and
# needs no calibration. The tensors are read past, not used.
IGNORED_SUFFIXES = (".input_scale",)
_IGNORABLE_MODULES = ("lm_head",)  # never quantized here


def checkpoint_quantization(config: Any) -> str | None:
    """``"fp8"`` for a supported pre-quantized checkpoint, None for a full-precision one.

    Raises ``ValueError`` naming the ``quantization_config`` field for any other scheme.
    """
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "fp8":
        _check_fp8(qc)
    elif method == "compressed-tensors":
        _check_compressed_tensors(qc)
    else:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; supported: fp8, compressed-tensors "
            "(float8 e4m3 weights)"
        )
    return "fp8"


def _check_fp8(qc: dict[str, Any]) -> None:
    if qc.get("weight_block_size"):
        raise ValueError(f"quantization_config.weight_block_size={qc['weight_block_size']!r}: block-wise FP8 "
                         "scales are not supported; only one scale per tensor or per output channel")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt={qc['fmt']!r} is not supported; only e4m3")
    _check_ignored("quantization_config.ignored_layers", qc.get("ignored_layers") or [])


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format={fmt!r} is not supported; only float-quantized "
                         "(float8 weights) compressed-tensors checkpoints")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty: nothing says how the weights are quantized")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"{where}.weights: only 8-bit float weights are supported, got type="
                             f"{weights.get('type')!r} num_bits={weights.get('num_bits')!r}")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy={weights.get('strategy')!r} is not supported; "
                             "only channel or tensor")
        acts = group.get("input_activations")
        if acts and (acts.get("type") != "float" or acts.get("num_bits") != 8):
            raise ValueError(f"{where}.input_activations: only 8-bit float activations are supported, got type="
                             f"{acts.get('type')!r} num_bits={acts.get('num_bits')!r}")
    _check_ignored("quantization_config.ignore", qc.get("ignore") or [])
    _check_kv_cache_scheme(qc.get("kv_cache_scheme"))


def _check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """The calibrated KV cache a compressed-tensors export describes: float8, one scale per layer."""
    if not scheme:
        return
    where = "quantization_config.kv_cache_scheme"
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise ValueError(f"{where}: only an 8-bit float KV cache is supported, got type={scheme.get('type')!r} "
                         f"num_bits={scheme.get('num_bits')!r}")
    if scheme.get("strategy", "tensor") != "tensor":
        raise ValueError(f"{where}.strategy={scheme['strategy']!r} is not supported; only tensor "
                         "(one k_scale and one v_scale per layer)")


def _check_ignored(field: str, names: list[str]) -> None:
    # NOTE: every decoder linear layer must be quantized: a layer left in full precision
    # would need a second weight layout inside one model.
    kept = [n for n in names if n.split(".")[-1] not in _IGNORABLE_MODULES]
    if kept:
        shown = ", ".join(map(repr, kept[:3])) + (" ..." if len(kept) > 3 else "")
        raise ValueError(f"{field} leaves {shown} unquantized; only the lm_head may be left out")
