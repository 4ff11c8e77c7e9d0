"""Celery task signature for apps that already speak Celery (celery is an optional extra).

A GPU worker consumes the ``sluiceway`` Celery queue itself, with its own Redis as broker
and result backend unless told otherwise (no Celery worker process; see
``worker/celery_ingress.py``):

    from producers.celery_app import generate_signature

    res = generate_signature(prompt="Hi", sampling={"max_tokens": 32}).apply_async()
    res.get(timeout=60)  # {"id": ..., "text": ..., "outputs": [...], "usage": {...}, ...}

While the job runs, ``res.state == "PROGRESS"`` and ``res.info["text"]`` is the text so
far; ``res.revoke()`` cancels it. The Celery task id is the job's id. The app needs a
Redis broker and Redis result backend the worker can reach.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams
from producers.errors import JobExpired, JobFailed
from producers.jobs import make_job

if TYPE_CHECKING:
    from celery import Celery, Signature

TASK_NAME = "sluiceway.generate"
CELERY_QUEUE = "sluiceway"
PROGRESS = "PROGRESS"  # the state a running job's task reports, with {"text": ...} as its info

# "task <id> <status> [<error_code>]: <error>", the one argument of a stored failure
_FAILURE_TEXT = re.compile(r"^task (?P<id>\S+) (?P<status>\w+)(?: \[(?P<code>[a-z_]+)\])?(?:: (?P<error>.*))?$", re.S)


class TaskFailed(JobFailed):
    """A ``sluiceway.generate`` failure as stored in Celery's result backend.

    NOTE: its one argument is its whole text, so Celery rebuilds it in any process: one that
    imported this module gets this class back (``job_id``, ``status``, ``error_code``,
    ``error`` parsed from the text); any other gets Celery's stand-in of the same name whose
    text is the same. ``error_code`` is the protocol's code when the worker gave one.
    """

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        found = _FAILURE_TEXT.match(str(message))
        self.message = str(message)
        self.job_id = found["id"] if found else None
        self.status = found["status"] if found else "failed"
        self.error_code = found["code"] if found else None
        self.code = self.error_code  # as on every ``JobError``
        self.error = found["error"] if found else self.message

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, task_id: str, status: str, error: str | None, error_code: str | None = None) -> TaskFailed:
        code = f" [{error_code}]" if error_code else ""
        return cls(f"task {task_id} {status}{code}" + (f": {error}" if error else ""))


class TaskExpired(TaskFailed, JobExpired):
    """The job's own ``deadline`` passed before it finished (``expires`` revokes instead, as in Celery)."""


_CELERY_JOB_FIELDS = {"prompt", "messages", "prompt_token_ids", "sampling", "priority", "deadline", "metadata"}


def generate_signature(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt_token_ids: list[int] | None = None,
    sampling: Mapping[str, Any] | SamplingParams | None = None,
    priority: int = 0,
    deadline: float | int | timedelta | datetime | None = None,
    metadata: Mapping[str, Any] | None = None,
    app: Celery | None = None,
    queue: str = CELERY_QUEUE,
) -> Signature:
    """A signature of the ``sluiceway.generate`` task, validated like ``Client.submit``.

    ``InvalidJob`` is raised here, in the app, rather than later in the worker.
    """
    from celery import signature  # NOTE: imported here so celery stays an optional extra

    job = make_job(
        prompt, messages=messages, prompt_token_ids=prompt_token_ids, sampling=sampling,
        priority=priority, deadline=deadline, metadata=metadata,
    )
    kwargs = job.model_dump(mode="json", include=_CELERY_JOB_FIELDS, exclude_none=True)
    return signature(TASK_NAME, kwargs=kwargs, queue=queue, app=app)
