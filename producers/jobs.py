"""The I/O-free half of the clients: building jobs and reading how they ended.

``Client`` and ``AsyncClient`` do only the Redis calls and share everything here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from engine.sampling_params import SamplingParams
from producers.errors import InvalidJob, JobCancelled, JobError, JobExpired, JobFailed, JobNotFound
from producers.protocol import (
    Job,
    JobField,
    JobResult,
    JobStatus,
    ProtocolError,
    Status,
    check_queue_name,
    describe_validation_error,
    new_job_id,
)

# NOTE: a bare number is read as seconds from now when it is below this (year 2001 as a unix
# time), and as a unix time above it; no real deadline is 30 years away.
ABSOLUTE_DEADLINE_AFTER = 1e9

_ERRORS: dict[Status, type[JobError]] = {
    Status.FAILED: JobFailed,
    Status.CANCELLED: JobCancelled,
    Status.EXPIRED: JobExpired,
}

# Keyword arguments of ``submit`` that an item of ``submit_many`` may carry.
SUBMIT_FIELDS = frozenset(
    {"prompt", "messages", "prompt_token_ids", "sampling", "queue", "priority", "deadline",
     "metadata", "stream", "job_id", "id"}
)


def queue_name(name: Any) -> str:
    try:
        return check_queue_name(name)
    except ValueError as exc:
        raise InvalidJob(str(exc)) from None


def to_deadline(deadline: float | int | timedelta | datetime | None, now: float | None = None) -> float | None:
    """A unix time from a unix time, a ``datetime``, a ``timedelta`` or seconds from now."""
    if deadline is None:
        return None
    now = time.time() if now is None else now
    if isinstance(deadline, datetime):
        return deadline.timestamp()
    if isinstance(deadline, timedelta):
        return now + deadline.total_seconds()
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise InvalidJob(f"deadline must be a unix time, seconds from now, a timedelta or a datetime, got {deadline!r}")
    return float(deadline) if deadline > ABSOLUTE_DEADLINE_AFTER else now + float(deadline)


def make_job(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt_token_ids: list[int] | None = None,
    sampling: Mapping[str, Any] | SamplingParams | None = None,
    priority: int = 0,
    deadline: float | int | timedelta | datetime | None = None,
    metadata: Mapping[str, Any] | None = None,
    stream: bool = False,
    job_id: str | None = None,
) -> Job:
    """Validate one job; ``InvalidJob`` names every bad field."""
    if isinstance(sampling, SamplingParams):
        sampling = sampling.to_dict()
    data = {
        "id": new_job_id() if job_id is None else job_id,
        "prompt": prompt,
        "messages": messages,
        "prompt_token_ids": prompt_token_ids,
        "sampling": dict(sampling or {}),
        "priority": priority,
        "deadline": to_deadline(deadline),
        "stream": stream,
        "metadata": dict(metadata or {}),
    }
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise InvalidJob(describe_validation_error(exc)) from None


def make_job_from_item(item: Mapping[str, Any] | Job, default_queue: str) -> tuple[Job, str]:
    """One item of ``submit_many``: a ``Job`` or a dict of ``submit``'s keyword arguments."""
    if isinstance(item, Job):
        return item, default_queue
    unknown = sorted(set(item) - SUBMIT_FIELDS)
    if unknown:
        raise InvalidJob(f"unknown job field(s): {', '.join(unknown)}")
    kwargs = dict(item)
    queue = queue_name(kwargs.pop("queue", None) or default_queue)
    if "id" in kwargs:
        kwargs["job_id"] = kwargs.pop("id")
    return make_job(**kwargs), queue


def outcome(job_id: str, fields: Mapping[Any, Any], prefix: str) -> JobResult | None:
    """The result of an ended job, ``None`` while it runs; raises how it ended otherwise."""
    if not fields:
        raise JobNotFound(job_id, prefix)
    status = JobStatus.from_hash(job_id, fields)
    if not status.terminal:
        return None
    if status.status is not Status.DONE:
        raise _ERRORS[status.status](job_id, status.status.value, status.error)
    raw = fields.get(JobField.RESULT, fields.get(JobField.RESULT.encode()))
    if raw is None:
        raise ProtocolError(f"job {job_id} is done but its hash holds no result", job_id)
    return JobResult.model_validate_json(raw)


def status_of(job_id: str, fields: Mapping[Any, Any], prefix: str) -> JobStatus:
    if not fields:
        raise JobNotFound(job_id, prefix)
    return JobStatus.from_hash(job_id, fields)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a ``time.monotonic()`` deadline (``None``: no limit; never negative)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
