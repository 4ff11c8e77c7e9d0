"""Celery ingress: the worker takes ``sluiceway.generate`` tasks off a Celery queue itself.

On by default (``--no-celery`` turns it off): broker and result backend are the worker's own
Redis -- the private one too, when ``--redis`` is unset -- unless ``--celery-broker`` /
``--celery-backend`` name others. Without the celery package the worker warns once and runs
without this component.

No Celery worker process runs. This component consumes the Celery queue (``sluiceway`` by
default) on the Redis broker through kombu, as a Celery worker would, and offers each task
to admission as ``Work`` whose sink is this component. The job id is the Celery task id
(or a digest of it, ``worker.celery_tasks.job_id``). Results go to Celery's Redis result
backend, so ``AsyncResult.get()`` in the app works:

- while the job runs: state ``PROGRESS``, info ``{"text": <text so far>, "completion_tokens": n}``;
- done: ``SUCCESS`` with the ``JobResult`` dict; failed / expired: ``FAILURE`` with
  ``TaskFailed`` / ``TaskExpired`` (``producers.celery_app``); cancelled: ``REVOKED``.

``AsyncResult.revoke()`` (a broadcast on Celery's control mailbox) cancels the task,
running or not yet read; so does ``sluiceway cancel <job id>`` (the task id, or its digest
when the id is no protocol id: ``worker.celery_tasks.job_id``). A message is acknowledged
only after its end is stored; a worker that stops first puts it back on the queue. A message is
taken off the queue and recorded as unacknowledged in one atomic step (``worker/celery_taking.py``):
a worker killed at any moment leaves each of its messages on the queue or in ``unacked``.
Only JSON messages are accepted, of Celery's message protocol 2 or 1. As with a Celery worker:
a task past its ``expires`` when it would start is ``REVOKED`` unrun (a running one is never
stopped by it); one with an ``eta`` / ``countdown`` waits here, unacknowledged, outside the
engine, until then;
``time_limit`` / ``soft_time_limit`` end a running one with ``TimeLimitExceeded`` /
``SoftTimeLimitExceeded``. Canvas (chords, chains, ``link``, ``link_error``): see
``worker/celery_results.py``; ``--celery-config`` names the configuration (routes) the
callbacks are sent with. A dead holder's tasks come back within the claim time
(``_recover``); ``worker/celery_control.py`` answers ``celery inspect`` and sends events.

Kombu connections are not thread-safe: everything that touches the broker runs on this
component's thread. This file is the reader (tasks and revokes in); the result writer
(``worker/celery_results.py``) is the tasks' sink, whose operations this thread applies;
``worker/celery_tasks.py`` turns a message into a job.
"""

from __future__ import annotations

import heapq
import json
import logging
import socket
import time
from collections import OrderedDict
from typing import Any

from producers.celery_app import CELERY_QUEUE, PROGRESS, TASK_NAME
from worker.admission import Admission, Held, Work
from worker.celery_control import CeleryControl
from worker.celery_results import CeleryResults, Delivery
from worker.celery_taking import taking_channel
from worker.celery_tasks import CeleryTask, TaskRefused, as_protocol_2, job_id, read_request, read_task
from worker.component import Component
from worker.logs import event
from worker.metrics import Metrics

log = logging.getLogger(__name__)

REVOKED_REMEMBERED = 10_000  # revoked ids kept for tasks not read yet (as a Celery worker keeps them)
DRAIN_S = 0.1  # how long one round waits on the broker
# NOTE: kombu blocks in BRPOP this long (its default is 1 s) and waits out an outstanding one when
# the connection closes, so it bounds how long a stop takes. Fractions need Redis >= 6.
BRPOP_S = 0.1


def load_celery_config(config: str) -> object:
    """The Celery configuration object ``config`` names ('module' or 'module:attr'); ValueError,
    naming the setting, when it cannot be loaded. ImportError only when celery itself is missing."""
    from celery.utils.imports import symbol_by_name  # NOTE: celery is an optional extra

    try:
        return symbol_by_name(config)
    except (ImportError, AttributeError, ValueError) as exc:  # NOTE: not "celery unavailable"
        raise ValueError(f"celery_config: cannot load {config[:200]!r} (module or module:attr): {exc}") from None


class CeleryIngress(Component):
    """Consumes ``sluiceway.generate`` tasks into ``admission``; ``results`` stores their ends."""

    name = "celery"

    def __init__(self, broker_url: str, backend_url: str | None, admission: Admission, held: Held, worker_name: str,
                 *, celery_queue: str = CELERY_QUEUE, prefetch: int = 64, metrics: Metrics | None = None,
                 config: str | None = None, result_ttl: int | None = None, claim_idle_s: float = 60.0,
                 broker_options: dict | None = None, backend_options: dict | None = None) -> None:
        """``broker_options`` / ``backend_options``: transport options a URL needs (a sentinel's
        ``master_name``: ``producers.connection.celery_target``); the backend's default to the broker's."""
        super().__init__()
        from celery import Celery  # NOTE: celery is an optional extra; imported only when enabled

        self.app = Celery("sluiceway-ingress", broker=broker_url, backend=backend_url or broker_url)
        if broker_options or backend_options:
            self.app.conf.update(broker_transport_options=dict(broker_options or {}),
                                 result_backend_transport_options=dict(
                                     (backend_options if backend_url else broker_options) or {}))
        configured = load_celery_config(config) if config else None
        if configured is not None:
            self.app.config_from_object(configured)  # the app's routes, result_expires, result_extended, ...
        if result_ttl is not None and not hasattr(configured, "result_expires"):
            self.app.conf.result_expires = result_ttl  # NOTE: the configuration's own result_expires wins
        transport = {**(self.app.conf.broker_transport_options or {}), "polling_interval": BRPOP_S}
        self.app.conf.update(accept_content=["json"], result_accept_content=["json"], result_serializer="json",
                             task_serializer="json", broker_transport_options=transport)
        self.results = CeleryResults(self.app, held, metrics)  # the tasks' sink
        self.admission = admission
        self.held = held
        self.node_name = f"sluiceway@{worker_name}"
        self.celery_queue = celery_queue
        self.prefetch = prefetch
        self._revoked: OrderedDict[str, None] = OrderedDict()
        self._waiting: list[tuple[float, int, Any, CeleryTask]] = []  # (eta, n, message, task): a heap
        self.claim_idle_s = claim_idle_s
        self._next_recovery = 0.0  # monotonic seconds
        self._conn = None
        self._tasks = None  # the task consumer, while it consumes
        self._node = None  # the control mailbox's node, while it listens
        self.control = CeleryControl(self)  # replies to celery inspect, task events
        self.results.events = self.control.send

    # --- the thread -----------------------------------------------------------------------------
    def tick(self) -> None:
        if self._conn is None:
            self._connect()
        self.results.apply()
        self._start_due()
        self._recover()
        self._throttle()
        try:
            self._conn.drain_events(timeout=DRAIN_S)
        except socket.timeout:
            pass
        self.results.write_progress()
        self.control.heartbeat()

    def _connect(self) -> None:
        from kombu import Exchange, Queue

        conn = self.app.connection_for_read()
        # NOTE: before the first channel exists (connecting makes one): each message is taken and
        # recorded in one atomic step, not kombu's BRPOP then a write (worker/celery_taking.py)
        conn.transport.Channel = taking_channel(conn.transport.Channel)
        conn.ensure_connection(max_retries=1)
        task_queue = Queue(self.celery_queue, Exchange(self.celery_queue, type="direct"), routing_key=self.celery_queue)
        self._tasks = conn.Consumer(task_queue, callbacks=[self._on_task], accept=["json"],
                                    on_decode_error=self._on_undecodable, prefetch_count=1)
        self._tasks.consume()
        # NOTE: the control mailbox gets a channel of its own. On the tasks' channel it would share
        # their prefetch limit: with the engine full, kombu would neither read revokes nor stop
        # reporting their socket readable -- revokes would wait and this thread would spin.
        node = self.app.control.mailbox.Node(self.node_name, channel=conn.channel(), handlers=self.control.handlers)
        node.listen(callback=self._on_control)
        self._node = node
        self._conn = conn
        event(log, "celery.consuming", queue=self.celery_queue, node=self.node_name)

    def _recover(self) -> None:
        """Every quarter claim time: mark the tasks held here as live; take back those of dead holders.

        NOTE: kombu's Redis transport gives an unacknowledged message back once its entry in
        ``unacked_index`` is older than the visibility timeout (an hour by default). Here every
        message this worker holds -- running, waiting in admission or for its eta -- has its
        entry made new again, so no consumer of this Redis, ours or a Celery worker with any
        visibility timeout above the claim time, gives back a task whose holder is alive. An
        entry of this queue older than the claim time has lost its holder: it goes back on the
        queue once (kombu's restore, under kombu's restore mutex) and, if it had started, its
        state becomes ``PROGRESS`` with ``{"requeued": true}``.
        """
        now = time.monotonic()
        if self._tasks is None or now < self._next_recovery:
            return
        self._next_recovery = now + max(0.25, self.claim_idle_s / 4)
        from kombu.transport.redis import Mutex, MutexHeld

        channel = self._tasks.channel
        index = channel.unacked_index_key
        tags = [d.message.delivery_tag for d in self.results.deliveries()] + [w[2].delivery_tag for w in self._waiting]
        # NOTE: a pooled connection of kombu's, not the one its poller has a BRPOP outstanding on
        with channel.conn_or_acquire() as client:
            if tags:
                client.zadd(index, {tag: time.time() for tag in tags}, xx=True)
            stale = client.zrange(index, time.time() - self.claim_idle_s, 0, desc=True, byscore=True, offset=0,
                                  num=100)
            if not stale:
                return
            try:
                with Mutex(client, channel.unacked_mutex_key, channel.unacked_mutex_expire):
                    for tag in stale:
                        self._take_back(channel, client, tag)
            except MutexHeld:
                pass  # another consumer restores now; what is left waits for the next round

    def _take_back(self, channel: Any, client: Any, tag: Any) -> None:
        raw = client.hget(channel.unacked_key, tag)
        if raw is None:
            return  # acknowledged or restored meanwhile
        try:
            message, _, routing_key = json.loads(raw)
        except (TypeError, ValueError):
            return  # not kombu's: not ours to touch
        if routing_key != self.celery_queue:
            return  # another queue's consumers and their visibility timeout decide
        from celery.states import READY_STATES

        # NOTE: protocol 1 keeps the id in the body; Celery sends it as correlation_id too
        headers, properties = message.get("headers") or {}, message.get("properties") or {}
        task_id = str(headers.get("id") or properties.get("correlation_id") or "")
        state = self.app.backend.get_state(task_id) if task_id else None
        if state in READY_STATES:
            # NOTE: its holder died after storing its end and before acknowledging it. Run again,
            # it would send its callbacks and count its chord part a second time.
            client.pipeline().zrem(channel.unacked_index_key, tag).hdel(channel.unacked_key, tag).execute()
            event(log, "celery.dropped", logging.WARNING, task=task_id, state=state,
                  reason=f"its holder stored its end and was silent {self.claim_idle_s:g}s before acknowledging")
            return
        channel.qos.restore_by_tag(tag, client)
        event(log, "celery.requeued", logging.WARNING, task=task_id or None,
              reason=f"its holder was silent {self.claim_idle_s:g}s")
        if state == PROGRESS:
            self.app.backend.store_result(task_id, {"text": "", "completion_tokens": 0, "requeued": True}, PROGRESS)

    def _throttle(self) -> None:
        """Take only what the engine has room for: unacknowledged messages <= held + room."""
        if self._tasks is None:
            return
        if not self.admission.open:
            self._tasks.cancel()  # draining: leave the queue to other workers
            self._tasks = None
            return
        # NOTE: tasks waiting for their eta hold a prefetch slot (kombu counts them unacknowledged), not a KV slot.
        limit = len(self._waiting) + min(self.prefetch, len(self.results) + self.admission.room())
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
            self.results.apply()
            self.results.requeue_all()
            while self._waiting:
                heapq.heappop(self._waiting)[2].requeue()
        except Exception:
            event(log, "celery.stop_error", logging.WARNING, exc_info=True)
        self.control.close(offline=True)
        self._close()
        self.app.close()

    def _close(self) -> None:
        conn, self._conn, self._tasks, self._node = self._conn, None, None, None
        self._waiting.clear()  # NOTE: unacknowledged on a closed channel: kombu gives them back
        if conn is not None:
            try:
                conn.release()
            except Exception:
                pass

    # --- incoming -------------------------------------------------------------------------------
    def _on_task(self, body: Any, message: Any) -> None:
        body, headers = as_protocol_2(body, dict(message.headers or {}))
        task_id = str(headers.get("id") or "")
        if headers.get("task") != TASK_NAME:
            # NOTE: with its request context, so a chord it is part of counts it and fails (Celery's
            # own worker stores an unknown task's failure without its chord: the chord waits for ever)
            self.results.refuse(message, task_id, f"this queue serves only {TASK_NAME}, not {headers.get('task')!r}",
                                read_request(body, message, self.node_name, headers))
            return
        try:
            task = read_task(task_id, body, message, self.node_name, headers)
        except TaskRefused as exc:
            self.results.refuse(message, task_id, str(exc), exc.request)
            return
        if self.results.holds(task.job.id):  # a second delivery of a task we run
            self.results.redelivered(task.job.id, message)
            return
        request = task.request
        self.control.send("task-received", task, name=TASK_NAME, args=repr(request["args"]),
                          kwargs=repr(request["kwargs"]), root_id=request.get("root_id"),
                          parent_id=request.get("parent_id"), retries=request.get("retries") or 0,
                          eta=request.get("eta"), expires=request.get("expires"))
        if task.eta is not None and task.eta > time.time() and task.job.id not in self._revoked:
            heapq.heappush(self._waiting, (task.eta, id(message), message, task))
            return
        self._start(message, task)

    def _start_due(self) -> None:
        """Start the tasks whose eta has come."""
        now = time.time()
        while self._waiting and self._waiting[0][0] <= now:
            _, _, message, task = heapq.heappop(self._waiting)
            self._start(message, task)

    def _start(self, message: Any, task: CeleryTask) -> None:
        if task.job.id in self._revoked:
            self.results.revoked_unread(message, task, "revoked before it started")
            return
        if task.expired():
            self.results.revoked_unread(message, task, "expired before it started")
            return
        now = time.time()
        job, limit_at = task.job, None
        if task.limit() is not None:
            limit_at = now + task.limit()[0]
            if job.deadline is None or limit_at < job.deadline:
                job = job.model_copy(update={"deadline": limit_at})
        work = Work(job=job, sink=self.results, queue=f"celery:{self.celery_queue}", entry_id=None,
                    enqueued_at=now, started_at=now)
        self.results.hold(work, Delivery(message, task, limit_at=limit_at))
        if not self.admission.offer([work]):
            self.results.give_back(work)

    def _on_undecodable(self, message: Any, exc: Exception) -> None:
        # NOTE: protocol 1 keeps the id in the body, unread here; Celery sends it as correlation_id too
        task_id = str((message.headers or {}).get("id") or (message.properties or {}).get("correlation_id") or "")
        self.results.refuse(message, task_id, f"not a JSON task message ({message.content_type}): {exc}")

    def _on_control(self, body: Any, message: Any = None) -> None:
        """A command on Celery's control mailbox: kombu's node calls its handler and replies."""
        if isinstance(body, dict) and self._node is not None:
            self._node.handle_message(body, message)

    def revoke(self, task_id: str) -> None:
        """Revoke a task: cancel it if held, end it if waiting for its eta, else refuse it when read."""
        job = job_id(task_id)
        waiting = [w for w in self._waiting if w[3].job.id == job]
        if self.results.holds(job):
            self.admission.cancel(job, "revoked through Celery")
        elif waiting:  # NOTE: ended at once rather than at its eta: nothing of it ever runs
            self._waiting.remove(waiting[0])
            heapq.heapify(self._waiting)
            self.results.revoked_unread(waiting[0][2], waiting[0][3], "revoked before it started")
        else:
            self._revoked[job] = None
            while len(self._revoked) > REVOKED_REMEMBERED:
                self._revoked.popitem(last=False)
