"""Celery ingress: the worker takes ``sluiceway.generate`` tasks off a Celery queue itself.

On by default (``--no-celery`` turns it off): broker and result backend are the worker's own
Redis -- the private one too, when ``--redis`` is unset -- unless ``--celery-broker`` /
``--celery-backend`` name others. Without the celery package the worker warns once and runs
without this component.

No Celery worker process runs. This component consumes the Celery queue (``sluiceway`` by
default) on the Redis broker through kombu, as a Celery worker would, and offers each task
to admission as ``Work`` whose sink is this component. The Celery task id is the job id.
Results go to Celery's Redis result backend, so ``AsyncResult.get()`` in the app works:

- while the job runs: state ``PROGRESS``, info ``{"text": <text so far>, "completion_tokens": n}``;
- done: ``SUCCESS`` with the ``JobResult`` dict; failed / expired: ``FAILURE`` with
  ``JobFailed`` / ``JobExpired`` (from ``producers.errors``); cancelled: ``REVOKED``.

``AsyncResult.revoke()`` (a broadcast on Celery's control mailbox) cancels the task,
running or not yet read; so does ``sluiceway cancel <task id>``. A message is acknowledged
only after its end is stored; a worker that stops first puts it back on the queue.
Only JSON messages are accepted; ``eta`` / ``countdown`` are not honoured (tasks run at once),
``expires`` becomes the job's deadline.

Kombu connections are not thread-safe: everything that touches the broker runs on this
component's thread; the step loop only appends to a queue (``publish`` / ``finish`` / ``release``).
"""

from __future__ import annotations

import logging
import queue
import socket
import time
from collections import OrderedDict
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import ValidationError

from producers.celery_app import CELERY_QUEUE, PROGRESS, TASK_NAME
from producers.errors import JobExpired, JobFailed
from producers.protocol import PROTOCOL_VERSION, Job, JobResult, Status, TokenDelta, describe_validation_error
from worker.admission import Admission, Held, Work
from worker.component import Component
from worker.logs import event
from worker.metrics import Metrics

log = logging.getLogger(__name__)

REVOKED_REMEMBERED = 10_000  # revoked ids kept for tasks not read yet (as a Celery worker keeps them)
PROGRESS_EVERY_S = 0.25  # at most one PROGRESS write per job this often
DRAIN_S = 0.1  # how long one round waits on the broker
# NOTE: kombu blocks in BRPOP this long (its default is 1 s) and waits out an outstanding one when
# the connection closes, so it bounds how long a stop takes. Fractions need Redis >= 6.
BRPOP_S = 0.1


class CeleryIngress(Component):
    """Consumes ``sluiceway.generate`` tasks into ``admission``; stores their ends in the result backend."""

    name = "celery"

    def __init__(self, broker_url: str, backend_url: str | None, admission: Admission, held: Held, worker_name: str,
                 *, celery_queue: str = CELERY_QUEUE, prefetch: int = 64, metrics: Metrics | None = None) -> None:
        super().__init__()
        from celery import Celery  # NOTE: celery is an optional extra; imported only when enabled

        self.app = Celery("sluiceway-ingress", broker=broker_url, backend=backend_url or broker_url)
        self.app.conf.update(accept_content=["json"], result_accept_content=["json"], result_serializer="json",
                             task_serializer="json", broker_transport_options={"polling_interval": BRPOP_S})
        self.backend = self.app.backend
        self.admission = admission
        self.held = held
        self.node_name = f"sluiceway@{worker_name}"
        self.celery_queue = celery_queue
        self.prefetch = prefetch
        self.metrics = metrics
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # (kind, work, payload) from the step loop
        self._messages: dict[str, Any] = {}  # task id -> kombu message, until acknowledged
        self._revoked: OrderedDict[str, None] = OrderedDict()
        self._text: dict[str, list] = {}  # task id -> [text so far, tokens so far, last write, dirty]
        self._conn = None
        self._tasks = None  # the task consumer, while it consumes

    # --- Sink: called from the step loop, never blocks ------------------------------------------
    def publish(self, work: Work, deltas: list[TokenDelta]) -> None:
        self._ops.put(("progress", work, deltas))

    def finish(self, work: Work, status: Status, result: JobResult | None = None, error: str | None = None) -> None:
        self._ops.put(("finish", work, (status, result, error)))

    def release(self, work: Work) -> None:
        self._ops.put(("release", work, None))

    # --- the thread -----------------------------------------------------------------------------
    def tick(self) -> None:
        if self._conn is None:
            self._connect()
        self._apply_ops()
        self._throttle()
        try:
            self._conn.drain_events(timeout=DRAIN_S)
        except socket.timeout:
            pass
        self._write_progress()

    def _connect(self) -> None:
        from kombu import Exchange, Queue

        conn = self.app.connection_for_read()
        conn.ensure_connection(max_retries=1)
        task_queue = Queue(self.celery_queue, Exchange(self.celery_queue, type="direct"), routing_key=self.celery_queue)
        self._tasks = conn.Consumer(task_queue, callbacks=[self._on_task], accept=["json"],
                                    on_decode_error=self._on_undecodable, prefetch_count=1)
        self._tasks.consume()
        # NOTE: the control mailbox gets a channel of its own. On the tasks' channel it would share
        # their prefetch limit: with the engine full, kombu would neither read revokes nor stop
        # reporting their socket readable -- revokes would wait and this thread would spin.
        node = self.app.control.mailbox.Node(self.node_name, channel=conn.channel())
        node.listen(callback=self._on_control)
        self._conn = conn
        event(log, "celery.consuming", queue=self.celery_queue, node=self.node_name)

    def _throttle(self) -> None:
        """Take only what the engine has room for: unacknowledged messages <= held + room."""
        if self._tasks is None:
            return
        if not self.admission.open:
            self._tasks.cancel()  # draining: leave the queue to other workers
            self._tasks = None
            return
        limit = min(self.prefetch, len(self._messages) + self.admission.room())
        self._tasks.qos(prefetch_count=max(1, limit))  # NOTE: 0 would mean "no limit"

    def on_redis_down(self) -> None:
        self._close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop consuming; store what the step loop handed over; give back tasks not ended.

        ``timeout=0`` only asks the thread to stop (it finishes its round on the broker); a
        later ``stop()`` waits for it and does the rest.
        """
        super().stop(timeout)
        if not timeout:
            return  # NOTE: the thread may still hold the connection, and kombu's is not thread-safe
        try:
            self._apply_ops()
            for task_id in list(self._messages):
                self._messages.pop(task_id).requeue()
        except Exception:
            event(log, "celery.stop_error", logging.WARNING, exc_info=True)
        self._close()
        self.app.close()

    def _close(self) -> None:
        conn, self._conn, self._tasks = self._conn, None, None
        if conn is not None:
            try:
                conn.release()
            except Exception:
                pass

    # --- incoming -------------------------------------------------------------------------------
    def _on_task(self, body: Any, message: Any) -> None:
        headers = message.headers or {}
        task_id = str(headers.get("id") or "")
        if headers.get("task") != TASK_NAME:
            self._refuse(message, task_id, f"this queue serves only {TASK_NAME}, not {headers.get('task')!r}")
            return
        if self.held.get(task_id) is not None:  # a second delivery of a task we run: ack the newest
            previous, self._messages[task_id] = self._messages.get(task_id), message
            if previous is not None:
                previous.ack()
            return
        if task_id in self._revoked:
            self.backend.mark_as_revoked(task_id, "revoked before it started")
            message.ack()
            return
        try:
            job = task_job(task_id, body, headers)
        except ValueError as exc:
            self._refuse(message, task_id, str(exc))
            return
        now = time.time()
        work = Work(job=job, sink=self, queue=f"celery:{self.celery_queue}", entry_id=None,
                    enqueued_at=now, started_at=now)
        self._messages[task_id] = message
        self.held.add(work)
        if not self.admission.offer([work]):
            self._forget(work)
            self._messages.pop(task_id).requeue()

    def _refuse(self, message: Any, task_id: str, error: str) -> None:
        event(log, "celery.refused", logging.WARNING, task=task_id or None, error=error)
        if task_id:
            self.backend.mark_as_failure(task_id, JobFailed(task_id, Status.FAILED.value, error))
        message.ack()

    def _on_undecodable(self, message: Any, exc: Exception) -> None:
        task_id = str((message.headers or {}).get("id") or "")
        self._refuse(message, task_id, f"not a JSON task message ({message.content_type}): {exc}")

    def _on_control(self, body: Any, message: Any = None) -> None:
        """Broadcasts on Celery's control mailbox; only ``revoke`` concerns us."""
        if not isinstance(body, dict) or body.get("method") != "revoke":
            return
        destination = body.get("destination")
        if destination and self.node_name not in destination:
            return
        task_ids = (body.get("arguments") or {}).get("task_id") or []
        for task_id in [task_ids] if isinstance(task_ids, str) else task_ids:
            if task_id in self._messages:
                self.admission.cancel(task_id, "revoked through Celery")
            else:
                self._revoked[task_id] = None
                while len(self._revoked) > REVOKED_REMEMBERED:
                    self._revoked.popitem(last=False)

    # --- outgoing -------------------------------------------------------------------------------
    def _apply_ops(self) -> None:
        while True:
            try:
                kind, work, payload = self._ops.get_nowait()
            except queue.Empty:
                return
            if kind == "progress":
                state = self._text.setdefault(work.id, ["", 0, 0.0, False])
                for delta in payload:
                    if delta.index == 0:
                        state[0] += delta.text
                        state[1] += len(delta.token_ids)
                        state[3] = True
            elif kind == "finish":
                self._store_end(work, *payload)
            else:
                self._forget(work)
                message = self._messages.pop(work.id, None)
                if message is not None:
                    message.requeue()

    def _store_end(self, work: Work, status: Status, result: JobResult | None, error: str | None) -> None:
        task_id = work.id
        if status is Status.DONE and result is not None:
            self.backend.mark_as_done(task_id, result.model_dump(mode="json"))
        elif status is Status.CANCELLED:
            self.backend.mark_as_revoked(task_id, error or "cancelled")
        else:
            cls = JobExpired if status is Status.EXPIRED else JobFailed
            self.backend.mark_as_failure(task_id, cls(task_id, status.value, error))
        self._forget(work)
        message = self._messages.pop(task_id, None)
        if message is not None:
            message.ack()
        if self.metrics is not None:
            self.metrics.job_ended(status.value)
        event(log, "job.ended", job=task_id, status=status.value, queue=work.queue, error=error or None)

    def _write_progress(self) -> None:
        now = time.monotonic()
        for task_id, state in self._text.items():
            text, tokens, last, dirty = state
            if dirty and now - last >= PROGRESS_EVERY_S:
                self.backend.store_result(task_id, {"text": text, "completion_tokens": tokens}, PROGRESS)
                state[2], state[3] = now, False

    def _forget(self, work: Work) -> None:
        self.held.discard(work)
        self._text.pop(work.id, None)


def task_job(task_id: str, body: Any, headers: dict) -> Job:
    """The job of a Celery (protocol 2) message: ``[args, kwargs, embed]``; ``ValueError`` names the problem."""
    if not (isinstance(body, (list, tuple)) and len(body) == 3):
        raise ValueError("the message body is not a Celery protocol 2 body [args, kwargs, embed]")
    args, kwargs, _ = body
    kwargs = dict(kwargs or {})
    if args:
        if len(args) != 1 or "prompt" in kwargs:
            raise ValueError(f"{TASK_NAME} takes one positional argument (the prompt), got {len(args)}")
        kwargs["prompt"] = args[0]
    for name in ("id", "v", "stream"):
        if name in kwargs:
            raise ValueError(f"{name}: not a {TASK_NAME} argument (the task id is the job id)")
    expires = headers.get("expires")
    if expires and kwargs.get("deadline") is None:
        kwargs["deadline"] = datetime.fromisoformat(expires).timestamp()
    try:
        # NOTE: stream=True makes the step loop hand deltas over; they become PROGRESS states.
        return Job.model_validate({**kwargs, "v": PROTOCOL_VERSION, "id": task_id, "stream": True})
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc)) from None


def celery_url(redis_url: str) -> str:
    """The Celery spelling of a redis-py URL, for broker and result backend alike.

    ``unix:///path?db=N`` becomes ``redis+socket:///path?virtual_host=N``; a ``rediss://`` URL
    without ``ssl_cert_reqs`` gets ``ssl_cert_reqs=required`` -- redis-py's default, which
    Celery will not assume (its backend refuses such a URL; kombu would skip the check).
    """
    parts = urlsplit(redis_url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.scheme == "unix":
        query = [("virtual_host" if k == "db" else k, v) for k, v in query]
        return _url("redis+socket", parts.netloc, parts.path, query)
    if parts.scheme == "rediss" and not any(k == "ssl_cert_reqs" for k, _ in query):
        return _url("rediss", parts.netloc, parts.path, [*query, ("ssl_cert_reqs", "required")])
    return redis_url


def broker_redis_url(broker_url: str) -> str:
    """The redis-py spelling of a Celery Redis broker URL (``celery_url`` undone), to read queue depths."""
    parts = urlsplit(broker_url)
    if parts.scheme in ("redis+socket", "socket"):
        query = parse_qsl(parts.query, keep_blank_values=True)
        return _url("unix", parts.netloc, parts.path, [("db" if k == "virtual_host" else k, v) for k, v in query])
    return broker_url


def _url(scheme: str, netloc: str, path: str, query: list[tuple[str, str]]) -> str:
    # NOTE: not urlunsplit, which drops the empty host of "unix:///path"
    return f"{scheme}://{netloc}{path}" + (f"?{urlencode(query)}" if query else "")
