"""The one closed set of machine-readable reasons a job ends other than ``done``.

Every job that does not end ``done`` carries one of these in its hash's ``error_code`` field,
in its dead letter (when it has one) and in the client's exception (``JobFailed.code``),
beside the free-text ``error``. PROTOCOL.md ("Error codes") lists them; a reader that meets a
code it does not know treats it as a plain failure of the job's status.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_JOB = "invalid_job"  # the entry is not a valid job: bad JSON, a bad field, a type, a limit
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt (+ max_tokens) does not fit the model
    CANCELLED = "cancelled"  # a client cancelled it (or revoked the Celery task)
    EXPIRED = "expired"  # its deadline passed, before or while it ran
    MAX_ATTEMPTS_EXCEEDED = "max_attempts_exceeded"  # every worker that took it stopped before finishing
    ENGINE_ERROR = "engine_error"  # the engine failed while running it (or its tokenizer did)
    UNSTORABLE_OUTPUT = "unstorable_output"  # its outcome could not be stored (unserializable, a key of another type)


def error_code_of(value: object) -> ErrorCode | str | None:
    """A hash's ``error_code`` value as an ``ErrorCode``; an unknown code stays text, empty is None."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if value in (None, ""):
        return None
    try:
        return ErrorCode(value)
    except ValueError:
        return str(value)
