"""Sluiceway's inference engine: a vLLM-style offline API over a paged KV cache.

The package root imports lazily so that ``engine.sampling_params`` stays usable without
torch (the producers reuse it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "ContinuationScore",
]

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineArgs": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "ContinuationScore": "engine.outputs",
}

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, ContinuationScore, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
