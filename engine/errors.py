"""Errors of the engine's API that callers tell apart (torch-free, like ``sampling_params``)."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A request whose prompt, with ``max_tokens``, can never fit the model's context or KV cache."""
