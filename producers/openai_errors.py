"""The error of an OpenAI completions or chat body that cannot become a job.

Raised by the shared translation (``producers.openai_format``, ``openai_completions``,
``openai_tools`` callers): the gateway answers it as its 400 (``gateway/translate.py``), a
batch line as an error line (``producers.openai_batch``).
"""

from __future__ import annotations

from typing import Any

from producers.protocol.limits import abbreviate


class RequestError(ValueError):
    """A body that cannot become a job: ``param`` names the field (OpenAI's ``param``), ``code``
    is the envelope's code (``invalid_value``, ``unknown_parameter`` or None)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def invalid_value(param: str, value: Any, rule: str) -> RequestError:
    """The error naming the field, its value (abbreviated) and the rule it breaks."""
    return RequestError(f"{param}: {rule}, got {abbreviate(value)}", param, code="invalid_value")
