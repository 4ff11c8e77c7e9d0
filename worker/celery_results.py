"""The Celery result writer: the ``Sink`` of Celery tasks, stored in Celery's result backend.

The step loop hands each task's deltas and end over as typed operations, at once and without
touching the broker; the ingress thread applies them (``apply``), because kombu's
connections are not thread-safe and the task's message must be acknowledged (or put back)
on the thread that received it:

- deltas accumulate into the task's ``PROGRESS`` state, ``{"text": ..., "completion_tokens": n}``,
  written at most every ``PROGRESS_EVERY_S`` (``write_progress``);
- done: ``SUCCESS`` with the ``JobResult`` dict; failed / expired: ``FAILURE`` with
  ``JobFailed`` / ``JobExpired`` (from ``producers.errors``); cancelled: ``REVOKED``; then
  the message is acknowledged;
- released (the worker stops): the message goes back on its queue, untouched.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

from producers.celery_app import PROGRESS
from producers.errors import job_error
from producers.protocol import ErrorCode, JobResult, Status, TokenDelta
from worker.admission import Held, Work
from worker.logs import event
from worker.metrics import Metrics

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.25  # at most one PROGRESS write per job this often


@dataclass
class Progress:
    """Deltas handed over by the step loop, to publish as a ``PROGRESS`` state."""

    work: Work
    deltas: list[TokenDelta]


@dataclass
class Finish:
    """A task's end, to store and acknowledge."""

    work: Work
    status: Status
    result: JobResult | None
    error: str | None
    code: ErrorCode | None = None


@dataclass
class Release:
    """A task the worker gives back: its message is requeued."""

    work: Work


@dataclass
class TaskText:
    """A running task's text so far (completion 0), and when it was last written."""

    text: str = ""
    completion_tokens: int = 0
    written_at: float = 0.0  # monotonic seconds
    dirty: bool = False  # changed since written


class CeleryResults:
    """Sink of Celery tasks: queues typed operations from the step loop, applies them on the ingress thread."""

    def __init__(self, backend: Any, held: Held, metrics: Metrics | None = None) -> None:
        self.backend = backend
        self.held = held
        self.metrics = metrics
        self._ops: queue.SimpleQueue[Progress | Finish | Release] = queue.SimpleQueue()
        self._messages: dict[str, Any] = {}  # task id -> kombu message, until acknowledged
        self._text: dict[str, TaskText] = {}

    # --- Sink: called from the step loop, never blocks ------------------------------------------
    def publish(self, work: Work, deltas: list[TokenDelta]) -> None:
        self._ops.put(Progress(work, deltas))

    def finish(self, work: Work, status: Status, result: JobResult | None = None, error: str | None = None,
               code: ErrorCode | None = None) -> None:
        self._ops.put(Finish(work, status, result, error, code))

    def release(self, work: Work) -> None:
        self._ops.put(Release(work))

    def checkpoint(self, work: Work, token_ids: list[int]) -> None:
        # NOTE: a Celery task has no job hash to hold progress: one redelivered runs from the start.
        return None

    # --- deliveries: the ingress thread ---------------------------------------------------------
    def hold(self, work: Work, message: Any) -> None:
        """Hold ``work`` until its end is stored; ``message`` is acknowledged then."""
        self._messages[work.id] = message
        self.held.add(work)

    def redelivered(self, task_id: str, message: Any) -> None:
        """A second delivery of a task already held: keep the newest message, acknowledge the older."""
        previous, self._messages[task_id] = self._messages.get(task_id), message
        if previous is not None:
            previous.ack()

    def give_back(self, work: Work) -> None:
        """Forget ``work`` and put its message back on the queue."""
        self._forget(work)
        message = self._messages.pop(work.id, None)
        if message is not None:
            message.requeue()

    def holds(self, task_id: str) -> bool:
        return task_id in self._messages

    def __len__(self) -> int:
        """Messages held unacknowledged."""
        return len(self._messages)

    def refuse(self, message: Any, task_id: str, error: str) -> None:
        """A message that is no job: its task (when it names one) fails with ``error``; acknowledged."""
        event(log, "celery.refused", logging.WARNING, task=task_id or None, error=error)
        if task_id:
            self.backend.mark_as_failure(task_id, job_error(task_id, Status.FAILED.value, error, ErrorCode.INVALID_JOB))
        message.ack()

    def revoked_unread(self, message: Any, task_id: str) -> None:
        """A task revoked before it was read: ``REVOKED``, acknowledged, never run."""
        self.backend.mark_as_revoked(task_id, "revoked before it started")
        message.ack()

    def requeue_all(self) -> None:
        """Put back every message not acknowledged yet (the worker stops)."""
        for task_id in list(self._messages):
            self._messages.pop(task_id).requeue()

    # --- applying what the step loop handed over: the ingress thread -----------------------------
    def apply(self) -> None:
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, Progress):
                self._add_text(op)
            elif isinstance(op, Finish):
                self._store_end(op)
            else:
                self.give_back(op.work)

    def _add_text(self, op: Progress) -> None:
        text = self._text.setdefault(op.work.id, TaskText())
        for delta in op.deltas:
            if delta.index == 0:
                text.text += delta.text
                text.completion_tokens += len(delta.token_ids)
                text.dirty = True

    def _store_end(self, op: Finish) -> None:
        task_id, status = op.work.id, op.status
        if status is Status.DONE and op.result is not None:
            self.backend.mark_as_done(task_id, op.result.model_dump(mode="json"))
        elif status is Status.CANCELLED:
            self.backend.mark_as_revoked(task_id, op.error or "cancelled")
        else:
            self.backend.mark_as_failure(task_id, job_error(task_id, status.value, op.error, op.code))
        self._forget(op.work)
        message = self._messages.pop(task_id, None)
        if message is not None:
            message.ack()
        if self.metrics is not None:
            self.metrics.job_ended(status.value)
        event(log, "job.ended", job=task_id, status=status.value, queue=op.work.queue, error=op.error or None)

    def write_progress(self) -> None:
        now = time.monotonic()
        for task_id, text in self._text.items():
            if text.dirty and now - text.written_at >= PROGRESS_EVERY_S:
                self.backend.store_result(task_id, {"text": text.text, "completion_tokens": text.completion_tokens},
                                          PROGRESS)
                text.written_at, text.dirty = now, False

    def _forget(self, work: Work) -> None:
        self.held.discard(work)
        self._text.pop(work.id, None)
