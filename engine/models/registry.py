"""HF ``architectures[0]`` -> our model class, and the limits a config puts on the engine."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"config has no 'architectures' entry; supported: {', '.join(MODELS)}")
    if architectures[0] not in MODELS:
        raise ValueError(f"architecture {architectures[0]!r} is not supported; supported: {', '.join(MODELS)}")
    return MODELS[architectures[0]]


def sliding_window(config: Any) -> int | None:
    """The attention window a config asks for, or None when attention is full."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if hasattr(config, "use_sliding_window"):  # Qwen2/Qwen3 configs carry a window they do not use
        return window if config.use_sliding_window else None
    return window  # Mistral


def check_max_model_len(config: Any, max_model_len: int) -> None:
    """Raise if serving ``max_model_len`` tokens would need attention we do not implement.

    NOTE: sliding-window attention is not implemented; a window at least as long as the
    longest sequence is the same as full attention, so such models still run.
    """
    window = sliding_window(config)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"this model uses sliding-window attention (sliding_window={window}), which is not "
            f"implemented; set max_model_len <= {window} (got {max_model_len}) to serve it with full attention"
        )
