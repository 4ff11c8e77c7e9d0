"""The result writer: one thread that drains the step loop's outputs into Redis, pipelined.

The step loop only appends to an in-memory queue, so it never waits on Redis. The writer
sends everything queued since its last round in one pipeline. When Redis is away it keeps
the batch and retries with backoff: nothing is lost. A job's end is the ``FINISH`` script
(result, status, done signal, acknowledgement in one atomic step); token deltas are plain
``XADD``s that precede it in the same order. A batch retried after a connection loss may
repeat deltas that did reach Redis (at-least-once); ends are exactly-once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis

from producers.protocol import JobResult, Keys, Status, TokenDelta
from worker.admission import Held, Work
from worker.component import Component
from worker.logs import event
from worker.metrics import Metrics
from worker.scripts import Scripts

log = logging.getLogger(__name__)

MAX_BATCH = 1024  # operations per pipeline round


@dataclass
class _Publish:
    work: Work
    deltas: list[TokenDelta]


@dataclass
class _Finish:
    work: Work
    status: Status
    result: JobResult | None
    error: str | None


@dataclass
class _Release:
    work: Work


class ResultWriter(Component):
    """The ``Sink`` of jobs read from the Redis queues."""

    name = "writer"

    def __init__(self, client: redis.Redis, keys: Keys, scripts: Scripts, held: Held, metrics: Metrics,
                 result_ttl: int) -> None:
        super().__init__()
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.held = held
        self.metrics = metrics
        self.result_ttl = result_ttl
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list = []  # taken from _ops, not yet written
        self._unwritten = 0  # queued and not yet written
        self._cond = threading.Condition()

    # --- Sink: called from the step loop, never blocks ----------------------------------------
    def publish(self, work: Work, deltas: list[TokenDelta]) -> None:
        if deltas:
            self._put(_Publish(work, deltas))

    def finish(self, work: Work, status: Status, result: JobResult | None = None, error: str | None = None) -> None:
        self._put(_Finish(work, status, result, error))

    def release(self, work: Work) -> None:
        self._put(_Release(work))

    def _put(self, op) -> None:
        with self._cond:
            self._unwritten += 1
        self._ops.put(op)

    # --- the thread ---------------------------------------------------------------------------
    def tick(self) -> None:
        if not self._batch:
            try:
                self._batch.append(self._ops.get(timeout=0.1))
            except queue.Empty:
                return
        while len(self._batch) < MAX_BATCH:
            try:
                self._batch.append(self._ops.get_nowait())
            except queue.Empty:
                break
        self._write(self._batch)
        self._batch = []

    def _write(self, batch: list) -> None:
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for op in batch:
            self._queue_op(pipe, op, now)
        replies = pipe.execute(raise_on_error=False)
        with self._cond:
            self._unwritten -= len(batch)
            self._cond.notify_all()
        for op, reply in self._replies(batch, replies):
            if isinstance(op, _Finish):
                self.held.discard(op.work)
                if reply == 1:
                    self.metrics.job_ended(op.status.value)
                    event(log, "job.ended", job=op.work.id, status=op.status.value, queue=op.work.queue,
                          attempt=op.work.attempt, error=op.error or None)
                else:
                    event(log, "job.already_ended", logging.DEBUG, job=op.work.id)
            elif isinstance(op, _Release):
                self.held.discard(op.work)
                event(log, "job.released", job=op.work.id, queue=op.work.queue)

    def _replies(self, batch: list, replies: list):
        """Pair each op with its reply (the finish or release reply for those ops)."""
        i = 0
        for op in batch:
            n = len(op.deltas) + 1 if isinstance(op, _Publish) else 1
            reply = replies[i + n - 1]
            failed = next((r for r in replies[i:i + n] if isinstance(r, Exception)), None)
            i += n
            if failed is not None:
                # NOTE: a reply error (a key of the wrong type, say) will not heal by retrying;
                # the entry stays pending and is retried by a claim, up to --max-attempts.
                event(log, "write.failed", logging.ERROR, job=op.work.id, op=type(op).__name__.strip("_").lower(),
                      error=str(failed))
                if not isinstance(op, _Publish):
                    self.held.discard(op.work)
                continue
            yield op, reply

    def _queue_op(self, pipe, op, now: float) -> None:
        work = op.work
        if isinstance(op, _Publish):
            key = self.keys.tokens(work.id)
            for delta in op.deltas:
                pipe.xadd(key, delta.to_fields())
            pipe.expire(key, self.result_ttl)
        elif isinstance(op, _Finish):
            # A streamed job that did not finish normally gets a closing entry naming its status.
            closing = work.job.stream and op.status is not Status.DONE
            self.scripts.finish(
                pipe, job_id=work.id, queue=work.queue, entry_id=work.entry_id, status=op.status.value, now=now,
                ttl=self.result_ttl, stream=work.job.stream,
                result=op.result.model_dump_json() if op.result is not None else "",
                error=op.error or "", finish_reason=op.status.value if closing else "",
            )
        else:
            self.scripts.release(pipe, job_id=work.id, queue=work.queue, entry_id=work.entry_id)

    # --- lifecycle ----------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unwritten <= 0, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is queued (retrying through an outage for up to ``timeout``), then stop."""
        flushed = self.flush(timeout)
        super().stop(timeout)
        if not flushed:
            # NOTE: the jobs concerned stay pending in their streams; a live worker claims them.
            event(log, "writer.gave_up", logging.ERROR, unwritten=self._unwritten)
