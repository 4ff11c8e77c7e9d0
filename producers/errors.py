"""Exceptions raised by the producer clients; each says what happened to which job."""

from __future__ import annotations

from producers.protocol.error_codes import ErrorCode, error_code_of


class SluicewayError(Exception):
    """Base of every error raised by ``producers``."""


class InvalidJob(SluicewayError, ValueError):
    """A job that breaks protocol v1; the message names the field, its value and the rule."""


class RevisionNotSpoken(InvalidJob):
    """A job with a field of a later protocol revision (``needed``) than a live worker of its queue
    speaks (``spoken``: the oldest revision of its live workers): any of them may take the job, and
    that one would refuse it, so it was not enqueued; ``field`` names it."""

    def __init__(self, message: str, field: str, needed: str, spoken: str) -> None:
        super().__init__(message, field, needed, spoken)  # NOTE: args rebuild the error (pickle)
        self.message = message
        self.field = field
        self.needed = needed
        self.spoken = spoken

    def __str__(self) -> str:
        return self.message

    @property
    def reason(self) -> str:
        """The message after its field (and its position, from ``submit_many``): the revision and
        what the workers speak, for a caller that names the field its own way (a batch line's ``body.echo``)."""
        return self.message.partition(f"{self.field}: ")[2]

    def at(self, index: int) -> RevisionNotSpoken:
        """The same refusal naming the job's position among several (``job 3: tools: ...``)."""
        return RevisionNotSpoken(f"job {index}: {self.message}", self.field, self.needed, self.spoken)


class JobNotFound(SluicewayError, LookupError):
    """No record of the job: never submitted under this prefix, or expired after ``result_ttl``."""

    def __init__(self, job_id: str, prefix: str) -> None:
        super().__init__(job_id, prefix)  # NOTE: args rebuild the error (pickle, Celery results)
        self.job_id = job_id
        self.prefix = prefix

    def __str__(self) -> str:
        return (
            f"job {self.job_id} is unknown under prefix {self.prefix!r}: it was never submitted there,"
            " or its record expired (result_ttl)"
        )


class JobError(SluicewayError):
    """A job that ended without a result; ``status`` is how it ended, ``error`` why, ``code`` the
    machine-readable reason (an ``ErrorCode`` value; None from a worker older than protocol 1.1)."""

    def __init__(self, job_id: str, status: str, error: str | None = None, code: str | None = None) -> None:
        super().__init__(job_id, status, error, code)
        self.job_id = job_id
        self.status = status
        self.error = error
        self.code = code

    def __str__(self) -> str:
        reason = f": {self.error}" if self.error else ""
        code = f" [{self.code}]" if self.code else ""
        return f"job {self.job_id} {self.status}{code}{reason}"


class JobFailed(JobError):
    """The worker failed the job (bad input, model error, retries exhausted); ``error`` says why."""


class JobCancelled(JobError):
    """The job was cancelled before it finished (``code`` ``cancelled``)."""


class JobExpired(JobError):
    """The job's deadline passed before it finished (``code`` ``expired``)."""


class InvalidJobFailed(JobFailed, InvalidJob):
    """A worker refused the job as invalid (``invalid_job``); ``except InvalidJob`` catches it too."""


class ContextLengthExceeded(JobFailed, InvalidJob):
    """The prompt, with ``max_tokens``, does not fit the model's context (``context_length_exceeded``)."""


class MaxAttemptsExceeded(JobFailed):
    """Every worker that took the job stopped before finishing it (``max_attempts_exceeded``)."""


class EngineError(JobFailed):
    """The engine (or its tokenizer) failed while running the job (``engine_error``)."""


class UnstorableOutput(JobFailed):
    """The job's outcome could not be stored in Redis (``unstorable_output``)."""


# The one mapping from an error code to its exception; ``job_error`` uses it.
ERROR_CLASSES: dict[ErrorCode, type[JobError]] = {
    ErrorCode.INVALID_JOB: InvalidJobFailed,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ContextLengthExceeded,
    ErrorCode.CANCELLED: JobCancelled,
    ErrorCode.EXPIRED: JobExpired,
    ErrorCode.MAX_ATTEMPTS_EXCEEDED: MaxAttemptsExceeded,
    ErrorCode.ENGINE_ERROR: EngineError,
    ErrorCode.UNSTORABLE_OUTPUT: UnstorableOutput,
}
_BY_STATUS: dict[str, type[JobError]] = {"failed": JobFailed, "cancelled": JobCancelled, "expired": JobExpired}


def job_error(job_id: str, status: str, error: str | None = None, code: ErrorCode | str | None = None) -> JobError:
    """The exception for a job that ended ``status`` with ``code``: the code's own class when it
    is a known code of that status's kind, else the status's (``JobFailed`` for an unknown code)."""
    base = _BY_STATUS.get(status, JobFailed)
    code_value = code.value if isinstance(code, ErrorCode) else code
    cls = ERROR_CLASSES.get(error_code_of(code_value), base) if code_value else base
    if not issubclass(cls, base):  # NOTE: a code that contradicts the status: the status wins
        cls = base
    return cls(job_id, status, error, code_value)


class Timeout(SluicewayError, TimeoutError):
    """A wait ran out of time; the job itself goes on."""

    def __init__(self, job_id: str, timeout: float | None) -> None:
        super().__init__(job_id, timeout)
        self.job_id = job_id
        self.timeout = timeout

    def __str__(self) -> str:
        return f"job {self.job_id} did not end within {self.timeout}s (it is still queued or running)"
