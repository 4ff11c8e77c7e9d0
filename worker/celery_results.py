"""The Celery result writer: the ``Sink`` of Celery tasks, stored in Celery's result backend.

The step loop hands each task's deltas and end over as typed operations, at once and without
touching the broker; the ingress thread applies them (``apply``), because kombu's
connections are not thread-safe and the task's message must be acknowledged (or put back)
on the thread that received it:

- deltas accumulate into the task's ``PROGRESS`` state, ``{"text": ..., "completion_tokens": n}``,
  written at most every ``PROGRESS_EVERY_S`` (``write_progress``);
- done: ``SUCCESS`` with the ``JobResult`` dict; failed / expired: ``FAILURE`` with
  ``TaskFailed`` / ``TaskExpired`` (``producers.celery_app``), ``TimeLimitExceeded`` /
  ``SoftTimeLimitExceeded`` past a time limit; cancelled: ``REVOKED``; then the message is
  acknowledged;
- released (the worker stops): the message goes back on its queue, untouched.

A task sent with ``ignore_result`` has no state stored, PROGRESS included, as Celery's worker
stores none; its chord, chain and callbacks still go on.

Each end is stored as Celery's own worker stores it (``celery/app/trace.py``): through the
backend's ``mark_as_*`` with the task's request context, so chord parts are counted, a
failure propagates down its chain and fires ``link_error``, and ``result_extended`` stores
the request; after a success the ``link`` callbacks and the next chain step are sent with
the worker's app, so the routing of ``--celery-config`` applies.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from producers.celery_app import PROGRESS, TaskExpired, TaskFailed
from producers.protocol import ErrorCode, JobResult, Status, TokenDelta
from worker.admission import Held, Work
from worker.celery_tasks import CeleryTask
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
class Delivery:
    """A task held unacknowledged: its message, what it asked for, and the limit it runs under."""

    message: Any
    task: CeleryTask
    limit_at: float | None = None  # unix seconds at which its time limit ends it
    started_at: float = field(default_factory=time.time)  # unix seconds: handed to admission
    running: bool = False  # its first tokens came (task-started was sent)
    context: Any = field(default=None, repr=False)  # celery.app.task.Context, made once

    def request(self) -> Any:
        if self.context is None:
            from celery.app.task import Context

            self.context = Context(self.task.request, id=self.task.task_id)
        return self.context


@dataclass
class TaskText:
    """A running task's text so far (completion 0), and when it was last written."""

    text: str = ""
    completion_tokens: int = 0
    written_at: float = 0.0  # monotonic seconds
    dirty: bool = False  # changed since written


class CeleryResults:
    """Sink of Celery tasks: queues typed operations from the step loop, applies them on the ingress thread."""

    def __init__(self, app: Any, held: Held, metrics: Metrics | None = None) -> None:
        self.app = app
        self.backend = app.backend
        self.held = held
        self.metrics = metrics
        self._ops: queue.SimpleQueue[Progress | Finish | Release] = queue.SimpleQueue()
        self._held: dict[str, Delivery] = {}  # job id -> its delivery, until acknowledged
        self._text: dict[str, TaskText] = {}
        self.events = lambda kind, task=None, **fields: None  # the ingress's event sender

    # --- Sink: called from the step loop, never blocks ------------------------------------------
    def publish(self, work: Work, deltas: list[TokenDelta]) -> None:
        self._ops.put(Progress(work, deltas))

    def publish_step(self, items: list[tuple[Work, list[TokenDelta]]]) -> None:
        for work, deltas in items:
            self.publish(work, deltas)

    def finish(self, work: Work, status: Status, result: JobResult | None = None, error: str | None = None,
               code: ErrorCode | None = None) -> None:
        self._ops.put(Finish(work, status, result, error, code))

    def release(self, work: Work) -> None:
        self._ops.put(Release(work))

    def checkpoint(self, work: Work, token_ids: list[int]) -> None:
        # NOTE: a Celery task has no job hash to hold progress: one redelivered runs from the start.
        return None

    # --- deliveries: the ingress thread ---------------------------------------------------------
    def hold(self, work: Work, delivery: Delivery) -> None:
        """Hold ``work`` until its end is stored; its message is acknowledged then."""
        self._held[work.id] = delivery
        self.held.add(work)

    def redelivered(self, job_id: str, message: Any) -> None:
        """A second delivery of a task already held: keep the newest message, acknowledge the older."""
        delivery = self._held[job_id]
        previous, delivery.message = delivery.message, message
        previous.ack()

    def give_back(self, work: Work) -> None:
        """Forget ``work`` and put its message back on the queue."""
        self._forget(work)
        delivery = self._held.pop(work.id, None)
        if delivery is not None:
            delivery.message.requeue()

    def holds(self, job_id: str) -> bool:
        return job_id in self._held

    def deliveries(self) -> list[Delivery]:
        return list(self._held.values())

    def __len__(self) -> int:
        """Messages held unacknowledged."""
        return len(self._held)

    def refuse(self, message: Any, task_id: str, error: str, request: dict | None = None) -> None:
        """A message that is no job: its task (when it names one) fails with ``error``; acknowledged.

        With its ``request`` read, the failure reaches its chord, chain and errbacks."""
        event(log, "celery.refused", logging.WARNING, task=task_id or None, error=error)
        try:
            if task_id:
                context = None
                if request is not None:
                    from celery.app.task import Context

                    context = Context(request, id=task_id)
                exc = TaskFailed.of(task_id, Status.FAILED.value, error, ErrorCode.INVALID_JOB.value)
                tb = self._fail(task_id, exc, context, store=not (request or {}).get("ignore_result"))
                self.events("task-failed", uuid=task_id, exception=repr(exc), traceback=tb)
        finally:
            message.ack()

    def revoked_unread(self, message: Any, task: CeleryTask, reason: str) -> None:
        """A task revoked (or expired) before it started: ``REVOKED``, acknowledged, never run."""
        self.backend.mark_as_revoked(task.task_id, reason, request=Delivery(message, task).request(),
                                     store_result=not task.ignore_result)
        message.ack()
        self.events("task-revoked", task, terminated=False, signum=None, expired=reason.startswith("expired"))

    def requeue_all(self) -> None:
        """Put back every message not acknowledged yet (the worker stops)."""
        for job_id in list(self._held):
            self._held.pop(job_id).message.requeue()

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
        delivery = self._held.get(op.work.id)
        if delivery is not None and not delivery.running:
            delivery.running = True
            self.events("task-started", delivery.task)
        text = self._text.setdefault(op.work.id, TaskText())
        for delta in op.deltas:
            if delta.index == 0:
                text.text += delta.text
                text.completion_tokens += len(delta.token_ids)
                text.dirty = True

    def _store_end(self, op: Finish) -> None:
        status = op.status
        delivery = self._held.pop(op.work.id, None)
        self._forget(op.work)
        if delivery is None:
            return  # given back already
        task_id, request = delivery.task.task_id, delivery.request()
        try:
            if status is Status.DONE and op.result is not None:
                value = op.result.model_dump(mode="json")
                # NOTE: sent before the end is stored, as Celery's worker does, so the stored
                # result lists them as its children.
                request.children.extend(self._send_next(value, request))
                self.backend.mark_as_done(task_id, value, request=request)  # NOTE: skips storing with ignore_result
                self.events("task-succeeded", delivery.task, result=repr(value)[:1024],
                            runtime=time.time() - delivery.started_at)
            elif status is Status.CANCELLED:
                self.backend.mark_as_revoked(task_id, op.error or "cancelled", request=request,
                                             store_result=not delivery.task.ignore_result)
                self.events("task-revoked", delivery.task, terminated=delivery.running, signum=None, expired=False)
            else:
                exc = self._failure(delivery, op)
                tb = self._fail(task_id, exc, request, store=not delivery.task.ignore_result)
                self.events("task-failed", delivery.task, exception=repr(exc), traceback=tb)
        finally:
            delivery.message.ack()
        if self.metrics is not None:
            self.metrics.job_ended(status.value)
        event(log, "job.ended", job=op.work.id, task=task_id, status=status.value, queue=op.work.queue,
              error=op.error or None)

    @staticmethod
    def _failure(delivery: Delivery, op: Finish) -> BaseException:
        """The exception a failed task stores: one that Celery rebuilds in any process."""
        task = delivery.task
        limit = task.limit()
        if op.status is Status.EXPIRED and limit is not None and delivery.limit_at is not None \
                and (op.work.job.deadline is None or delivery.limit_at <= op.work.job.deadline):
            from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

            cls = SoftTimeLimitExceeded if limit[1] == "soft_time_limit" else TimeLimitExceeded
            return cls(f"{limit[1]} ({limit[0]:g}s) exceeded")
        cls = TaskExpired if op.status is Status.EXPIRED else TaskFailed
        code = op.code or (ErrorCode.EXPIRED if op.status is Status.EXPIRED else None)
        return cls.of(task.task_id, op.status.value, op.error, ErrorCode(code).value if code else None)

    def _fail(self, task_id: str, exc: BaseException, request: Any, store: bool = True) -> str:
        # NOTE: the traceback is the worker's account of the failure: the job ran in the engine,
        # not in Python code of the task, so there is no deeper stack to show.
        tb = "Traceback (sluiceway worker):\n" + "".join(traceback.format_exception_only(type(exc), exc))
        self.backend.mark_as_failure(task_id, exc, traceback=tb, request=request, store_result=store)
        return tb

    def _send_next(self, value: Any, request: Any) -> list[Any]:
        """After a success: the ``link`` callbacks, then the next chain step, as Celery's worker sends them."""
        from celery import group, signature

        parent_id, root_id = request.id, request.root_id or request.id
        priority = (request.delivery_info or {}).get("priority")
        callbacks = [signature(c, app=self.app) for c in request.callbacks or ()]
        groups = [c for c in callbacks if isinstance(c, group)]
        singles = [c for c in callbacks if not isinstance(c, group)]
        sends = groups + ([singles[0]] if len(singles) == 1 else [group(singles, app=self.app)] if singles else [])
        sent = [sig.apply_async((value,), parent_id=parent_id, root_id=root_id, priority=priority) for sig in sends]
        if request.chain:
            step = signature(request.chain[-1], app=self.app)
            sent.append(step.apply_async((value,), chain=request.chain[:-1], parent_id=parent_id, root_id=root_id,
                                         priority=priority))
        return sent

    def write_progress(self) -> None:
        now = time.monotonic()
        for task_id, text in self._text.items():
            if text.dirty and now - text.written_at >= PROGRESS_EVERY_S:
                delivery = self._held.get(task_id)
                if delivery is None or delivery.task.ignore_result:
                    continue
                self.backend.store_result(delivery.task.task_id,
                                          {"text": text.text, "completion_tokens": text.completion_tokens},
                                          PROGRESS, request=delivery.request())
                text.written_at, text.dirty = now, False

    def _forget(self, work: Work) -> None:
        self.held.discard(work)
        self._text.pop(work.id, None)
