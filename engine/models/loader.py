"""Finding a checkpoint, building its model on the target device and filling its weights.

A model is named by a local folder, a hub id (read from the local HF cache, downloaded
when the machine is online) or a built-in preset (dummy weights only). Weights load
tensor by tensor through each parameter's ``weight_loader``, which reads only this
rank's slice from the safetensors file.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import ModelNotFound
from engine.layers.fp8 import FP8_DTYPE, check_fp8_device, check_quantization, quantize_rows
from engine.models.registry import check_max_model_len, get_model_class
from engine.layers.fp8_checkpoint import IGNORED_SUFFIXES, checkpoint_quantization
from engine.layers.kv_scales import KVScales, is_kv_scale
from engine.models.presets import is_preset, preset_config

__all__ = ["load_model", "load_hf_config", "resolve_model_path", "is_preset", "init_dummy_weights",
           "load_weights", "resolve_dtype", "resolve_device", "resolve_quantization"]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
# what a hub download fetches: config, weights, tokenizer files
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = ("1", "on", "yes", "true")


def load_model(
    model: str | os.PathLike | Any,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    *,
    hf_config: Any = None,
    revision: str | None = None,
    max_model_len: int | None = None,
    hf_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    quantization: str | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, Any]:
    """Build and fill the model named by ``model``; returns ``(model, hf_config)``.

    Args:
        model: a local checkpoint folder, a hub id, a preset name (see ``engine.models.presets``)
            or a ``transformers`` config object (the last two with ``load_format="dummy"``).
        load_format: "auto"/"safetensors" reads the checkpoint; "dummy" draws random
            weights (seeded by ``seed``) on the device, for benchmarks.
        dtype: "auto" (the config's dtype on CUDA, bfloat16 for float32 checkpoints;
            float32 on CPU), "float32", "bfloat16", "float16" or a ``torch.dtype``.
        device: "auto" (CUDA when available), "cuda", "cpu" or a ``torch.device``.
        hf_config: the config when the caller has already read it (``load_hf_config``).
        max_model_len: the longest sequence the engine will serve; checked against the
            model's attention window (defaults to ``max_position_embeddings``).
        hf_overrides: config fields to replace, e.g. ``{"num_hidden_layers": 2}``.
        quantization: None (the checkpoint's own, if it is a pre-quantized one) or "fp8"
            (see ``resolve_quantization``).
        kv_cache_dtype: the KV cache's dtype; a float8 cache takes the checkpoint's per-layer
            K/V scales, if it has them (``engine.layers.kv_scales``).
    """
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(_LOAD_FORMATS)}; got {load_format!r}")
    if load_format != "dummy" and _has_no_files(model):
        raise ValueError(
            f"{_describe(model)} has no weights; pass load_format='dummy' for random weights, "
            "or a checkpoint folder / hub id for real ones"
        )
    if hf_config is None:
        config = load_hf_config(model, revision, hf_overrides)
    else:
        config = _with_overrides(hf_config, hf_overrides)
    cls = get_model_class(config)
    check_max_model_len(config, max_model_len or config.max_position_embeddings)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, config, device)
    quantization = resolve_quantization(quantization, config, device)
    with torch.device(device):
        module = cls(config, dtype, quantization)
    if load_format == "dummy":
        init_dummy_weights(module, seed)
    else:
        load_weights(module, resolve_model_path(model, revision), kv_cache_dtype)
    return module.eval(), config


def load_hf_config(
    model: str | os.PathLike | Any, revision: str | None = None, hf_overrides: dict[str, Any] | None = None
) -> Any:
    """The ``transformers`` config of a folder, hub id, preset name or config object."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return _with_overrides(model, hf_overrides)
    if _is_preset_name(model):
        return preset_config(model, **(hf_overrides or {}))
    path = resolve_model_path(model, revision)
    return AutoConfig.from_pretrained(str(path), **(hf_overrides or {}))


def _with_overrides(config: Any, overrides: dict[str, Any] | None) -> Any:
    if not overrides:
        return config
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _is_preset_name(model: Any) -> bool:
    # a folder of the same name wins over the preset
    return isinstance(model, str) and is_preset(model) and not Path(model).is_dir()


def _has_no_files(model: Any) -> bool:
    return _is_preset_name(model) or not isinstance(model, (str, os.PathLike))


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder holding ``model``: the folder itself, or a hub id's snapshot.

    A hub id is looked up in the local HF cache first; if it is not there it is
    downloaded, unless the machine is offline (``HF_HUB_OFFLINE=1``).
    """
    model = os.fspath(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return _checked_folder(path.resolve(), model)
    if _is_preset_name(model):
        raise ValueError(f"{model!r} is a built-in preset with no files; load it with load_format='dummy'")
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelNotFound(f"model folder {model!r} does not exist")
    return _checked_folder(_resolve_hub_id(model, revision), model)


def _resolve_hub_id(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    # NOTE: huggingface_hub reads HF_HOME / HF_HUB_OFFLINE once, at import; we read them
    # per call so a process that sets them later (a worker's config, a test) is obeyed.
    cache_dir = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (OSError, ValueError) as err:
        if _offline():
            raise ModelNotFound(
                f"{repo_id!r} is not a local folder and is not in the HF cache at {cache_dir} "
                f"(HF_HOME={os.environ.get('HF_HOME', '<unset>')}), and HF_HUB_OFFLINE is set; "
                "download it on a connected machine into that cache, or pass a local folder"
            ) from err
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=_HUB_PATTERNS))
    except Exception as err:  # network, auth, unknown repo: say which id and where it was going
        raise ModelNotFound(
            f"could not download {repo_id!r} into {cache_dir}: {err}; on a machine without network "
            "set HF_HUB_OFFLINE=1 and fill the cache, or pass a local folder"
        ) from err


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps repos, by its own precedence of environment variables."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _checked_folder(path: Path, model: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{model!r} resolved to {path}, which has no config.json")
    return path


def _describe(model: Any) -> str:
    return f"preset {model!r}" if isinstance(model, str) else "a config object"


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu; got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available; use device='cpu'")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    """The parameter dtype: explicit, or "auto" (see ``load_model``)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    wanted = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(wanted, str):
        wanted = _DTYPES.get(wanted.removeprefix("torch."))
    # NOTE: float32 (or unset) checkpoints run in bfloat16 on GPUs, as vLLM does.
    return wanted if wanted in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_quantization(quantization: str | None, config: Any, device: torch.device) -> str | None:
    """The linear layers' quantization: the one asked for, else the checkpoint's own.

    A pre-quantized checkpoint (``quantization_config`` in its config.json) runs as it was
    quantized; asking for another method raises, naming both.
    """
    check_quantization(quantization)
    found = checkpoint_quantization(config)
    if found is not None and quantization is not None and found != quantization:
        raise ValueError(f"quantization={quantization!r}, but the checkpoint is quantized as {found!r}")
    quantization = quantization or found
    if quantization == "fp8":
        check_fp8_device(device)
    return quantization


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelNotFound(f"{index} names files that are not in {path}: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (only .bin files found; convert them to safetensors)" if any(path.glob("*.bin")) else ""
        raise ModelNotFound(f"no *.safetensors weights in {path}{hint}")
    return files


def load_weights(model: nn.Module, path: Path, kv_cache_dtype: torch.dtype | None = None) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``path``, this rank's shards only;
    K/V cache scales go to the attention layers when ``kv_cache_dtype`` is float8."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    ignored = getattr(model, "ignored_weights", ())
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    quantized = any(n.endswith(".weight_scale") for n in params)
    loaded: set[str] = set()
    kv_scales = KVScales()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(ignored) or (tied and name == "lm_head.weight"):
                    continue  # tied: the head is the embedding, already loaded
                if quantized and name.endswith(IGNORED_SUFFIXES):
                    continue
                if is_kv_scale(name):  # one value per layer: every rank reads it whole
                    kv_scales.read(name, f.get_tensor(name))
                    continue
                target, shard_id = _param_name(name, packed)
                if target not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} in {file.name} has no parameter in {type(model).__name__} "
                        f"(looked for {target!r})"
                    )
                param = params[target]
                tensor = f.get_slice(name)
                with torch.no_grad():
                    param.weight_loader(param, tensor, shard_id)
                loaded.add(target)
                if param.dtype == FP8_DTYPE and tensor.get_dtype() != "F8_E4M3":
                    loaded.add(target + "_scale")  # quantized as it loaded: the scales came with it
    kv_scales.apply(model, kv_cache_dtype)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {path} has no weights for {shown}")


def _param_name(name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """Checkpoint name -> (our parameter name, shard id or None), e.g. ``...q_proj.weight``
    -> (``...qkv_proj.weight``, "q")."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard_id = packed[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard_id
    return name, None


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights drawn on the parameters' device: norms 1, everything else N(0, std);
    a float8 weight is drawn in fp32 and quantized per output channel, filling its scales."""
    generators: dict[torch.device, torch.Generator] = {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if name.endswith(".weight_scale"):
            continue  # set with its weight
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if param.dtype == FP8_DTYPE:
            drawn = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, std, generator=gen)
            q, scale = quantize_rows(drawn)
            param.copy_(q)
            params[name + "_scale"].copy_(scale)
        else:
            param.normal_(0.0, std, generator=gen)
