"""Errors of the engine's API that callers tell apart (torch-free, like ``sampling_params``)."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A request whose prompt, with ``max_tokens``, can never fit the model's context or KV cache."""


class ModelNotFound(FileNotFoundError):
    """A model's files cannot be found or fetched: a folder that does not exist or lacks its
    config or weights, a hub id neither in the local cache nor downloadable. The message says
    which and where."""
