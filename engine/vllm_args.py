"""vLLM engine arguments the engine accepts without acting on them.

A vLLM script passes many ``LLM(...)`` arguments that only tune vLLM's own machinery (its
logging, its compilation, where it downloads to). Each one here is accepted where ignoring
it cannot change a result -- for any value, or only for the values listed -- and logged
once per process; a value that would need a feature the engine lacks raises ``ValueError``
saying so. Torch-free. ``docs/VLLM_COMPAT.md`` lists them with the same reasons.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("engine.config")

ANY = None  # every value is harmless to ignore


@dataclass(frozen=True)
class Ignored:
    why: str  # what the engine does instead, in the log and the error
    harmless: tuple[Any, ...] | None = ANY  # values that change nothing here; others raise


IGNORED: dict[str, Ignored] = {
    "trust_remote_code": Ignored("only built-in architectures load; no code from a checkpoint ever runs"),
    "disable_log_stats": Ignored("the engine logs no periodic stats (LLMEngine.get_stats() reads them)"),
    "enable_chunked_prefill": Ignored("prefill is always chunked to the step's token budget; outputs do not depend on it"),
    "download_dir": Ignored("hub checkpoints are read from (and downloaded to) the HF cache"),
    "tokenizer_mode": Ignored("the model's fast HF tokenizer is always used", ("auto", "hf")),
    "tokenizer_revision": Ignored("the tokenizer comes from the model's own revision", (None,)),
    "skip_tokenizer_init": Ignored("the tokenizer is always loaded", (False,)),
    "code_revision": Ignored("no checkpoint code ever runs"),
    "hf_token": Ignored("the HF cache's login, if any, is used"),
    "hf_overrides": Ignored("the checkpoint's config is used as it is", (None, {})),
    "rope_scaling": Ignored("the checkpoint's rope settings are used", (None, {})),
    "rope_theta": Ignored("the checkpoint's rope settings are used", (None,)),
    "served_model_name": Ignored("names matter only to a server"),
    "task": Ignored("the engine generates text only", ("auto", "generate")),
    "runner": Ignored("the engine generates text only", ("auto", "generate")),
    "convert": Ignored("the engine generates text only", ("auto", "none")),
    "enable_lora": Ignored("LoRA adapters are not supported", (False, None)),
    "max_loras": Ignored("only used with enable_lora"),
    "max_lora_rank": Ignored("only used with enable_lora"),
    "max_cpu_loras": Ignored("only used with enable_lora"),
    "fully_sharded_loras": Ignored("only used with enable_lora"),
    "pipeline_parallel_size": Ignored("pipeline parallelism is not supported", (1,)),
    "data_parallel_size": Ignored("data parallelism is not supported (run one engine per GPU group)", (1,)),
    "distributed_executor_backend": Ignored("ranks always run as local processes of this host"),
    "worker_cls": Ignored("the engine's own rank workers always run", ("auto",)),
    "worker_extension_cls": Ignored("the engine's own rank workers always run", ("",)),
    "disable_custom_all_reduce": Ignored("the all-reduce is chosen by all_reduce= (nccl by default)"),
    "cpu_offload_gb": Ignored("weights stay on the device; only memory use differs"),
    "kv_cache_memory_bytes": Ignored("the cache is sized by gpu_memory_utilization / num_gpu_blocks_override"),
    "calculate_kv_scales": Ignored("fp8 KV caches use the checkpoint's per-layer k_scale/v_scale, else 1; none are "
                                   "computed at run time", (False, None)),
    "max_seq_len_to_capture": Ignored("CUDA graphs cover the decode batches (enforce_eager turns them off)"),
    "compilation_config": Ignored("the engine compiles nothing beyond its Triton kernels and CUDA graphs"),
    "disable_async_output_proc": Ignored("outputs are processed as the engine's async_scheduling says"),
    "disable_cascade_attn": Ignored("no cascade attention; outputs do not depend on it"),
    "speculative_config": Ignored("no speculative decoding; it changes only speed, not the outputs' distribution"),
    "enable_sleep_mode": Ignored("LLM.sleep() is not supported; memory is freed by shutdown()"),
    "logprobs_mode": Ignored("logprobs are always the raw model's", ("raw_logprobs",)),
    "enable_prompt_embeds": Ignored("prompt embeddings are not supported", (False,)),
    "limit_mm_per_prompt": Ignored("text-only models: no multimodal input is taken"),
    "mm_processor_kwargs": Ignored("text-only models: no multimodal input is taken"),
    "allowed_local_media_path": Ignored("text-only models: no multimodal input is taken"),
    "enable_expert_parallel": Ignored("dense models only"),
    "max_parallel_loading_workers": Ignored("weights load in one pass per rank"),
    "use_tqdm_on_load": Ignored("loading shows no progress bar"),
    "structured_outputs_config": Ignored("no engine-wide structured-output backend setting"),
    "guided_decoding_backend": Ignored("no engine-wide structured-output backend setting"),
    "kv_transfer_config": Ignored("KV transfer between engines is not supported", (None,)),
}

_logged: set[str] = set()


def drop_ignored(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the accepted-and-ignored vLLM arguments (each logged once per process);
    raises ``ValueError`` for a value whose effect the engine cannot give."""
    kept = {}
    for name, value in kwargs.items():
        rule = IGNORED.get(name)
        if rule is None:
            kept[name] = value
            continue
        if rule.harmless is not ANY and not any(_same(value, ok) for ok in rule.harmless):
            allowed = ", ".join(repr(v) for v in rule.harmless)
            raise ValueError(f"{name}={_short(value)} is not supported: {rule.why} (accepted: {allowed})")
        if name not in _logged:
            _logged.add(name)
            logger.warning("engine argument %s=%s is accepted and ignored: %s", name, _short(value), rule.why)
    return kept


def _same(value: Any, ok: Any) -> bool:
    return type(value) is type(ok) and value == ok or (value is None and ok is None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
