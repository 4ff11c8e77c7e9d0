"""Exceptions raised by the producer clients; each says what happened to which job."""

from __future__ import annotations


class SluicewayError(Exception):
    """Base of every error raised by ``producers``."""


class InvalidJob(SluicewayError, ValueError):
    """A job that breaks protocol v1; the message names the field, its value and the rule."""


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
    """A job that ended without a result; ``status`` is how it ended, ``error`` why."""

    def __init__(self, job_id: str, status: str, error: str | None = None) -> None:
        super().__init__(job_id, status, error)
        self.job_id = job_id
        self.status = status
        self.error = error

    def __str__(self) -> str:
        reason = f": {self.error}" if self.error else ""
        return f"job {self.job_id} {self.status}{reason}"


class JobFailed(JobError):
    """The worker failed the job (bad input, model error, retries exhausted); ``error`` says why."""


class JobCancelled(JobError):
    """The job was cancelled before it finished."""


class JobExpired(JobError):
    """The job's deadline passed before it finished."""


class Timeout(SluicewayError, TimeoutError):
    """A wait ran out of time; the job itself goes on."""

    def __init__(self, job_id: str, timeout: float | None) -> None:
        super().__init__(job_id, timeout)
        self.job_id = job_id
        self.timeout = timeout

    def __str__(self) -> str:
        return f"job {self.job_id} did not end within {self.timeout}s (it is still queued or running)"
