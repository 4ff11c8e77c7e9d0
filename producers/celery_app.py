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

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams
from producers.jobs import make_job

if TYPE_CHECKING:
    from celery import Celery, Signature

TASK_NAME = "sluiceway.generate"
CELERY_QUEUE = "sluiceway"
PROGRESS = "PROGRESS"  # the state a running job's task reports, with {"text": ...} as its info

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
