"""Everything decided about the model before any weights load: where it is, its config, dtype, device."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineArgs, EngineConfig, ModelConfig, pick_fields, context_length


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Resolve the flags against the checkpoint (read its config, pick dtype and device) and
    build the config of each concern; each validates itself, naming the flag."""
    model = resolve_model(args)
    return EngineConfig(model, args.cache_config(), args.parallel_config(), args.scheduler_config(model.max_model_len),
                        resolve_kv_dtype(args.kv_cache_dtype, model.dtype, model.device))


def resolve_model(args: EngineArgs) -> ModelConfig:
    """Find the checkpoint (or preset), read its config and pick dtype, device and context."""
    from engine.models.loader import (is_preset, load_hf_config, resolve_device, resolve_dtype, resolve_model_path,
                                      resolve_quantization)

    device = resolve_device(args.device)
    if is_preset(args.model) and not Path(args.model).is_dir():
        if args.load_format != "dummy":
            raise ValueError(
                f"model: {args.model!r} is a built-in architecture without weights; pass load_format='dummy'"
            )
        path, model = None, args.model
    else:
        path = resolve_model_path(args.model, args.revision)
        model = str(path)
    hf_config = load_hf_config(model, args.revision)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    quantization = resolve_quantization(args.quantization, hf_config, device)
    # the flags that need no resolving (tokenizer, load_format, seed, ...) are taken as they are
    return pick_fields(ModelConfig, args, model=model, path=path, hf_config=hf_config, dtype=dtype, device=device,
                       max_model_len=args.max_model_len or context_length(hf_config), quantization=quantization,
                       prefill_graph_tokens=args.resolved_prefill_graph_tokens())


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's (``auto``) or float8 e4m3 (``fp8``, ``fp8_e4m3``)."""
    if kv_cache_dtype == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {major}.{minor}: use kv_cache_dtype='auto'"
        )
    from sluiceway_kernels._common import FP8_KV_DTYPE

    return FP8_KV_DTYPE
