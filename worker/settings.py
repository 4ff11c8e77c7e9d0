"""Worker settings: every ``sluiceway worker`` flag, each also read from ``SLUICEWAY_<FLAG>``.

One pydantic-settings model is the single source: the CLI builds one option per field
(``--claim-idle-seconds`` <-> ``SLUICEWAY_CLAIM_IDLE_SECONDS``), and flags given on the
command line win over the environment. The engine options are derived from
``EngineArgs``'s fields (name, type); each defaults to ``None``, meaning "the engine's own
default", so only what the operator set reaches ``EngineArgs``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import typing
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, create_model, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from engine.config import EngineArgs
from producers.protocol import DEFAULT_QUEUES, DEFAULT_RESULT_TTL_S
from producers.service_settings import RedisFields

GIB = 1 << 30
# NOTE: the largest duration a setting takes, in seconds (about 68 years): Redis's EXPIRE and
# XAUTOCLAIM (in ms) and a thread's timed wait all take it, where 1e300 or inf made the intake
# fail at every turn or a thread raise
MAX_SECONDS = 2**31 - 1


class _WorkerFields(RedisFields):
    """The worker's own settings (``redis``, ``prefix``, ``queue_shards``, ``log_level`` are every
    service's: ``producers/service_settings.py``); ``WorkerSettings`` adds one per engine argument."""

    model_config = SettingsConfigDict(allow_inf_nan=False)  # a float setting is a finite number

    # --- the worker -----------------------------------------------------------------------
    model: str = Field(description="model folder, hub id (resolved offline from the HF cache) or built-in name")
    served_model_name: str | None = Field(
        None, description="the model name this worker serves under in the OpenAI gateway's /v1/models"
                          " (default: --model as given)")
    queues: Annotated[tuple[str, ...], NoDecode] = Field(DEFAULT_QUEUES, description="queues to drain, comma-separated, highest priority first")
    name: str = Field(default_factory=socket.gethostname, description="consumer name; unique per live worker, stable across restarts (default: host name)")
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="where the engine runs")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the engine spans")
    swap_space: str = Field("auto", description="CPU swap pool in GiB, or 'auto' to size it from the queue backlog")
    swap_floor_gib: float = Field(1.0, ge=0, description="smallest swap pool under --swap-space auto")
    swap_cap_gib: float | None = Field(None, ge=0, description="largest swap pool under --swap-space auto (default: a quarter of host memory per GPU)")
    claim_idle_seconds: float = Field(60.0, gt=0, le=MAX_SECONDS, description="a job unacknowledged this long by a silent worker is claimed by a live one")
    max_attempts: int = Field(3, ge=1, description="deliveries after which a job is dead-lettered")
    result_ttl: int = Field(DEFAULT_RESULT_TTL_S, ge=1, le=MAX_SECONDS, description="seconds a finished job's hash, done signal and tokens are kept")
    grace_period: float = Field(30.0, ge=0, le=MAX_SECONDS, description="seconds SIGTERM waits for in-flight jobs before releasing the rest")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus metrics on this port (unset: off)")
    metrics_host: str = Field("0.0.0.0", description="address of the metrics endpoint")
    cancel_poll_seconds: float = Field(0.2, gt=0, le=MAX_SECONDS, description="how often cancel keys of in-flight jobs are checked")
    stream_interval_ms: float = Field(0.0, ge=0, le=10000, description="least time between two writes of a streamed job's tokens (0: every step's, as they come); longer writes fewer, larger token entries: docs/SCALING.md")
    late_admission: bool = Field(False, description="admit jobs that arrived during a step just before the next"
                                                    " is scheduled (after the step in flight ends on the GPU), so an"
                                                    " interactive job joins the next step rather than the one after;"
                                                    " the GPU idles while each step is scheduled and launched")
    checkpoint_seconds: float = Field(2.0, gt=0, le=MAX_SECONDS, description="how often the progress of running jobs that do not stream is checkpointed in their hash, so a job whose worker dies resumes from there")
    log_format: Literal["kv", "json"] = Field("kv", description="key=value lines or one JSON object per line")
    celery: bool = Field(True, description="also run the sluiceway.generate tasks Celery apps send to --celery-queue"
                                           " (default: on; without the celery package: a warning, then off)")
    celery_broker: str | None = Field(None, description="Celery broker URL (default: the worker's Redis -- the private one"
                                                        " when --redis is unset)")
    celery_backend: str | None = Field(None, description="Celery result backend URL (default: the broker)")
    celery_queue: str = Field("sluiceway", min_length=1, description="the Celery queue those tasks arrive on")
    celery_config: str | None = Field(None, description="a Celery configuration object ('module' or 'module:attr') for"
                                                        " the callbacks and chain steps the worker sends: task_routes,"
                                                        " result_expires, result_extended, ...")

    @field_validator("queues", mode="before")
    @classmethod
    def _split_queues(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [q.strip() for q in value.split(",")]
        return value

    @field_validator("queues")
    @classmethod
    def _check_queues(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not q or any(c.isspace() for c in q) for q in value):
            raise ValueError(f"queues must be non-empty names separated by commas, got {','.join(value)!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"queues must not repeat a name, got {','.join(value)!r}")
        return value

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        # NOTE: an empty SLUICEWAY_NAME (a compose file's unset variable) named every such worker
        # '', one consumer whose pending entries they would share
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"name must be a non-empty word without spaces, got {value!r}")
        return value

    @field_validator("swap_space")
    @classmethod
    def _check_swap_space(cls, value: str) -> str:
        if value == "auto":
            return value
        try:
            gib = float(value)
        except ValueError:
            raise ValueError(f"swap_space must be 'auto' or a number of GiB, got {value!r}") from None
        if not 0 <= gib < math.inf:
            raise ValueError(f"swap_space must be 'auto' or a finite number of GiB >= 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> "_WorkerFields":
        if self.swap_cap_gib is not None and self.swap_cap_gib < self.swap_floor_gib:
            raise ValueError(f"swap_cap_gib ({self.swap_cap_gib}) must be >= swap_floor_gib ({self.swap_floor_gib})")
        return self

    # --- derived ----------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The name the gateway serves this worker's model under (``--served-model-name``)."""
        return self.served_model_name or self.model

    @property
    def swap_auto(self) -> bool:
        return self.swap_space == "auto"

    @property
    def swap_floor_bytes(self) -> int:
        return int(self.swap_floor_gib * GIB)

    @property
    def swap_cap_bytes(self) -> int:
        if self.swap_cap_gib is not None:
            return int(self.swap_cap_gib * GIB)
        return max(self.swap_floor_bytes, host_memory_bytes() // 4 // self.tensor_parallel_size)

    @property
    def heartbeat_seconds(self) -> float:
        """Heartbeats come four times per claim window, so one late beat never loses a job."""
        return min(10.0, max(0.05, self.claim_idle_seconds / 4))

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``EngineArgs`` (the engine validates them)."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "device": self.device,
            "tensor_parallel_size": self.tensor_parallel_size,
            "swap_space": self.swap_floor_gib if self.swap_auto else float(self.swap_space),
        }
        kwargs.update({name: getattr(self, name) for name in ENGINE_FIELDS if getattr(self, name) is not None})
        return kwargs


# The engine arguments the worker settles itself: with its own help text and defaults
# (``model``, ``device``, ``tensor_parallel_size``), or its own meaning (``swap_space``: 'auto').
OWN_ENGINE_ARGS = frozenset(_WorkerFields.model_fields) & {f.name for f in dataclasses.fields(EngineArgs)}

# NOTE: the help text is the operator's view of an engine argument; the name, the type and
# the default ("the engine's own", None) come from ``EngineArgs`` itself, so a new engine
# argument is a new flag without an edit here (its help then says where it is documented).
ENGINE_HELP = {
    "structured_outputs_timeout_s": "seconds a structured-output grammar may take to compile before its job fails invalid_job (default 30)",
    "tokenizer": "tokenizer folder (default: the model's)",
    "revision": "model revision in the HF cache",
    "dtype": "auto, bfloat16, float16 or float32",
    "load_format": "auto, safetensors or dummy (random weights)",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "sequences per step",
    "max_num_batched_tokens": "tokens per step",
    "block_size": "KV cache block size in tokens",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (float8 e4m3, half the bytes)",
    "quantization": "fp8: float8 weights (one scale per output channel) and per-token activations"
                    " (default: the checkpoint's own)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "enable_prefix_caching": "share KV blocks of common prompt prefixes",
    "enforce_eager": "no CUDA graphs",
    "small_batch_kernels": "steps of up to 8 tokens run each decoder layer in five kernels (norms and SwiGLU"
                           " folded into the projections); default: off",
    "prefill_graph_tokens": "prompt-carrying steps of up to this many tokens replay CUDA graphs (prompts alone:"
                            " the whole forward; with decodes: all but attention); 0: eager; default: 512 on one GPU, 0 under"
                            " tensor parallelism",
    "express_lane_tokens": "an interactive prompt of up to this many tokens that outranks running work runs at once"
                           " beside the step in flight (its own CUDA graph, a high-priority stream), not after it;"
                           " implies --late-admission; one GPU; 0 (default): off; docs/SWAP.md",
    "all_reduce": "tensor parallel on GPUs: nccl (default) or symmetric (all-reduces up to 32 MiB over"
                  " symmetric memory)",
    "async_scheduling": "launch each step before the previous one's tokens are read back (default: on)",
    "seed": "engine sampling seed",
    "preemption_mode": "auto, swap or recompute",
    "scheduling_policy": "priority (default): jobs rank by queue (--queues order), then priority, and a"
                         " higher-ranked job preempts lower-ranked running work; fcfs: arrival order only",
    "attention_backend": "auto, torch or triton",
    "num_gpu_blocks_override": "fix the number of GPU KV blocks",
    "override_generation_config": "sampling defaults over the model's generation_config.json, e.g."
                                  " '{\"temperature\": 0.6}'",
}


def _engine_fields() -> dict[str, Any]:
    """One optional setting per ``EngineArgs`` field the worker does not settle itself."""
    hints = typing.get_type_hints(EngineArgs)
    fields = {}
    for f in dataclasses.fields(EngineArgs):
        if f.name in OWN_ENGINE_ARGS:
            continue
        help_text = ENGINE_HELP.get(f.name, f"engine argument {f.name} (engine.config.EngineArgs)")
        decode: tuple = ()
        if dict in {typing.get_origin(t) for t in (hints[f.name], *typing.get_args(hints[f.name]))}:
            # NOTE: a flag arrives as text, so a mapping is a JSON object in it, decoded here for the
            # flag and the environment alike (the flag was refused as "not a valid dictionary")
            decode = (NoDecode, BeforeValidator(_json_object))
        fields[f.name] = (Annotated[(hints[f.name] | None, *decode, Field(description=help_text))], None)
    return fields


def _json_object(value: Any) -> Any:
    """``value``, or the object a JSON text ``value`` holds; ValueError when it holds no object."""
    if not isinstance(value, str):
        return value
    try:
        decoded = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"must be a JSON object, got {value!r} ({exc})") from None
    if not isinstance(decoded, dict):
        raise ValueError(f"must be a JSON object, got {value!r}")
    return decoded


WorkerSettings = create_model("WorkerSettings", __base__=_WorkerFields, __module__=__name__, **_engine_fields())
WorkerSettings.__doc__ = """Everything a worker needs to run; see ``sluiceway worker --help``.

Its engine fields are ``EngineArgs``'s (``ENGINE_FIELDS``), each None unless set."""
ENGINE_FIELDS = tuple(name for name in WorkerSettings.model_fields if name not in _WorkerFields.model_fields)


def host_memory_bytes() -> int:
    """Physical memory of this host (Linux and macOS)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB
