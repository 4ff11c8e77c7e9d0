"""The result writer: one thread that drains the step loop's outputs into Redis, pipelined.

The step loop only appends to an in-memory queue, so it never waits on Redis. Each round
the writer gathers everything queued since the last one, per run: its token deltas, then
its end or its release, sent as one ``WRITE`` script call per run that ends or is released
(``producers/protocol/worker_scripts.py``), and one ``APPEND`` call per shard for all the runs that
only stream or checkpoint (up to ``APPEND_RUNS`` a call), each run fenced on its own owner
token and each call all or nothing. So:

- a run that lost its job to another worker writes nothing (``write.fenced``), and the step
  loop drops it from the engine;
- a transient error (Redis away, out of memory, loading, a failover) keeps the run's writes
  for the next round, retried with backoff: nothing is lost, nothing ends early;
- a write that can never be stored (output that cannot be serialized, a key of the wrong
  type) fails that one job, with the reason in its error, and the rest of the round goes on.

A round retried after a connection loss may repeat deltas that did reach Redis
(at-least-once); ends are exactly-once.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import redis

from producers.protocol import ErrorCode, JobResult, Keys, Status, TokenDelta
from worker.admission import Held, Work
from worker.component import REDIS_DOWN, Component, RedisBusy, is_transient
from worker.fencing import Fenced
from worker.logs import event
from worker.metrics import Metrics
from worker.outputs import merge_deltas
from worker.scripts import MAX_ERROR_CHARS, Scripts, storable

log = logging.getLogger(__name__)

MAX_BATCH = 1024  # operations per pipeline round
# NOTE: runs per APPEND call: one call blocks Redis for its whole length (~10 us a run)
APPEND_RUNS = 256


@dataclass
class _Publish:
    work: Work
    deltas: list[TokenDelta]
    # NOTE: the round that first tried to write it. Deltas are merged only with those of the
    # same round, so a retried round writes the very entries it may have written before (a
    # reader drops an entry that repeats; it could not take one that overlaps part of another).
    round: int | None = None


@dataclass
class _Finish:
    work: Work
    status: Status
    result: JobResult | None
    error: str | None
    code: ErrorCode | None = None


@dataclass
class _Release:
    work: Work


@dataclass
class _Checkpoint:
    work: Work
    token_ids: list[int]


@dataclass(eq=False)
class _RunWrite:
    """One run's operations of one round, written by one script call."""

    work: Work
    ops: list = field(default_factory=list)
    end: _Finish | _Release | None = None
    unstorable: str | None = None  # why its writes can never be stored: it is failed instead
    alone: bool = False  # written by its own WRITE call, not in a shared APPEND call

    def add(self, op) -> None:
        self.ops.append(op)
        if self.end is None and isinstance(op, (_Finish, _Release)):
            self.end = op

    @property
    def progress(self) -> str:
        """The run's latest checkpoint of this round as the hash keeps it, or ''."""
        last = next((op for op in reversed(self.ops) if isinstance(op, _Checkpoint)), None)
        return json.dumps({"token_ids": last.token_ids}, separators=(",", ":")) if last is not None else ""


class ResultWriter(Component):
    """The ``Sink`` of jobs read from the Redis queues."""

    name = "writer"

    def __init__(self, client: redis.Redis, keys: Keys, scripts: Scripts, held: Held, metrics: Metrics,
                 result_ttl: int, fenced: Fenced | None = None, stream_interval: float = 0.0) -> None:
        """``stream_interval``: the least time between two rounds that carry token deltas alone
        (ends and releases never wait), so a streamed job's tokens go out in fewer, larger entries."""
        super().__init__()
        self.stream_interval = stream_interval
        self._last_round = 0.0  # time.monotonic() of the last round written
        self._rounds = 0  # pipeline rounds sent, for _Publish.round
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.held = held
        self.metrics = metrics
        self.result_ttl = result_ttl
        self.fenced = fenced if fenced is not None else Fenced()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list = []  # taken from _ops, not yet written
        self._unwritten = 0  # queued and not yet written
        self._cond = threading.Condition()
        metrics.writer_unwritten.set_function(lambda: self._unwritten)
        metrics.writer_progress.set(time.time())

    # --- Sink: called from the step loop, never blocks ----------------------------------------
    def publish(self, work: Work, deltas: list[TokenDelta]) -> None:
        if deltas:
            self._put(_Publish(work, deltas))

    def publish_step(self, items: list[tuple[Work, list[TokenDelta]]]) -> None:
        """One step's deltas as one hand-over, so that one round writes them all (NOTE: put one
        by one, a round could start after the first few and leave the rest to another)."""
        ops = [_Publish(work, deltas) for work, deltas in items if deltas]
        if ops:
            with self._cond:
                self._unwritten += len(ops)
            self._ops.put(ops)

    def finish(self, work: Work, status: Status, result: JobResult | None = None, error: str | None = None,
               code: ErrorCode | None = None) -> None:
        self._put(_Finish(work, status, result, error, code))

    def release(self, work: Work) -> None:
        self._put(_Release(work))

    def checkpoint(self, work: Work, token_ids: list[int]) -> None:
        self._put(_Checkpoint(work, list(token_ids)))

    def _put(self, op) -> None:
        with self._cond:
            self._unwritten += 1
        self._ops.put(op)

    # --- the thread ---------------------------------------------------------------------------
    def tick(self) -> None:
        if not self._batch:
            try:
                self._take(self._ops.get(timeout=0.1))
            except queue.Empty:
                self.metrics.writer_progress.set(time.time())  # nothing to write is progress too
                return
        while len(self._batch) < MAX_BATCH:
            try:
                self._take(self._ops.get_nowait())
            except queue.Empty:
                break
        if self.stream_interval:
            self._linger()
        self._last_round = time.monotonic()
        try:
            self._batch = self._write(self._batch)
        except REDIS_DOWN:
            self.metrics.writer_retries.inc()
            raise
        if self._batch:
            self.metrics.writer_retries.inc()
            raise RedisBusy(f"{len(self._batch)} writes kept for the next round")

    def _linger(self) -> None:
        """While the batch holds only deltas, gather more until ``stream_interval`` has passed since
        the last round (or an end or a release arrives, which goes out at once)."""
        deadline = self._last_round + self.stream_interval
        while all(isinstance(op, _Publish) for op in self._batch) and len(self._batch) < MAX_BATCH:
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping:
                return
            try:
                self._take(self._ops.get(timeout=left))
            except queue.Empty:
                return

    def _take(self, item) -> None:
        if isinstance(item, list):  # a step's deltas (publish_step)
            self._batch.extend(item)
        else:
            self._batch.append(item)

    def _write(self, batch: list) -> list:
        """Write ``batch``; return the operations to retry (a transient error met them)."""
        runs: dict[int, _RunWrite] = {}
        for op in batch:
            runs.setdefault(id(op.work), _RunWrite(op.work)).add(op)
        retry: list = []
        failing = self._send(list(runs.values()), retry)
        while failing:  # NOTE: bounded: a failure end that fails for good falls back to a bare dead letter
            failing = self._send(failing, retry)
        written = len(batch) - len(retry)
        with self._cond:
            self._unwritten -= written
            self._cond.notify_all()
        if written:
            self.metrics.writer_progress.set(time.time())
        return retry

    def _send(self, runs: list[_RunWrite], retry: list) -> list[_RunWrite]:
        """One pipeline round over ``runs``; return the runs to send again in a further round
        (to fail, or alone: their shared ``append`` call met an error that names none of them)."""
        now = time.time()
        self._rounds += 1
        pipe = self.client.pipeline(transaction=False)
        sent: list[_RunWrite | list[_RunWrite]] = []
        failing: list[_RunWrite] = []
        shared: dict[int | None, list[tuple[_RunWrite, tuple]]] = {}
        for run in runs:
            try:
                if run.end is None and run.unstorable is None and not run.alone:
                    shared.setdefault(self.keys.shard_of(run.work.id), []).append((run, self._append_part(run)))
                else:
                    self._queue_run(pipe, run, now)
                    sent.append(run)
            except Exception as exc:  # its output cannot be serialized or encoded
                if run.unstorable is not None:
                    raise  # NOTE: a failure end is plain text and always encodes
                run.unstorable = f"{type(exc).__name__}: {exc}"
                failing.append(run)
        for parts in shared.values():  # NOTE: a call per shard: a script's keys share one slot
            for i in range(0, len(parts), APPEND_RUNS):
                chunk = parts[i:i + APPEND_RUNS]
                self.scripts.append(pipe, [part for _, part in chunk], ttl=self.result_ttl)
                sent.append([run for run, _ in chunk])
        replies = pipe.execute(raise_on_error=False) if sent else []
        for item, reply in zip(sent, replies):
            if isinstance(item, list):
                self._settle_shared(item, reply, retry, failing)
            elif isinstance(reply, Exception):
                self._refused(item, reply, retry, failing, now)
            else:
                self._settle(item, reply.decode() if isinstance(reply, bytes) else str(reply))
        return failing

    def _refused(self, run: _RunWrite, reply: Exception, retry: list, failing: list, now: float) -> None:
        if is_transient(reply):
            retry.extend(run.ops)
        elif run.unstorable is None:
            run.unstorable = f"{type(reply).__name__}: {reply}"
            failing.append(run)
        else:
            self._dead_letter(run, reply, now)

    def _settle_shared(self, runs: list[_RunWrite], reply, retry: list, failing: list) -> None:
        """The codes of one ``append`` call, one per run, or the error the whole call met."""
        if isinstance(reply, Exception):
            if is_transient(reply):  # it changed nothing (all or nothing): every run is retried
                for run in runs:
                    retry.extend(run.ops)
            else:
                for run in runs:  # NOTE: each alone, by WRITE, whose error names its run
                    run.alone = True
                    failing.append(run)
            return
        for run, code in zip(runs, reply):
            code = code.decode() if isinstance(code, bytes) else str(code)
            if code.startswith("WRONGTYPE"):
                run.unstorable = f"ResponseError: {code}"
                failing.append(run)
            else:
                self._settle(run, code)

    def _append_part(self, run: _RunWrite) -> tuple:
        work = run.work
        return self.scripts.append_part(job_id=work.id, queue=work.queue, entry_id=work.entry_id,
                                        attempt=work.attempt, deltas=[_delta_args(d) for d in self._merged(run)],
                                        progress=run.progress)

    def _queue_run(self, pipe, run: _RunWrite, now: float) -> None:
        work, end = run.work, run.end
        common = dict(job_id=work.id, queue=work.queue, entry_id=work.entry_id, attempt=work.attempt, now=now,
                      ttl=self.result_ttl)
        if run.unstorable is not None:
            error = storable(f"the worker could not store this job's output: {run.unstorable}")
            stream = work.job.stream
            self.scripts.write(pipe, **common, stream=stream, end="fail", status=Status.FAILED.value, error=error,
                               finish_reason=Status.FAILED.value if stream else "", code=ErrorCode.UNSTORABLE_OUTPUT)
            return
        deltas = [_delta_args(d) for d in self._merged(run)]
        if isinstance(end, _Finish):
            # A streamed job that did not finish normally gets a closing entry naming its status.
            closing = work.job.stream and end.status is not Status.DONE
            self.scripts.write(pipe, **common, stream=work.job.stream, deltas=deltas, end="finish",
                               status=end.status.value,
                               result=end.result.model_dump_json() if end.result is not None else "",
                               error=storable(end.error or "", 4 * MAX_ERROR_CHARS),
                               finish_reason=end.status.value if closing else "", code=end.code)
        else:
            self.scripts.write(pipe, **common, stream=work.job.stream, deltas=deltas,
                               end="release" if isinstance(end, _Release) else "", progress=run.progress)

    def _merged(self, run: _RunWrite) -> list[TokenDelta]:
        """The run's deltas, those of each round joined (``merge_deltas``)."""
        found: list[TokenDelta] = []
        group: list[TokenDelta] = []
        current = None
        for op in run.ops:
            if not isinstance(op, _Publish):
                continue
            if op.round is None:
                op.round = self._rounds
            if op.round != current:
                found += merge_deltas(group)
                group, current = [], op.round
            group += op.deltas
        return found + merge_deltas(group)

    def _settle(self, run: _RunWrite, reply: str) -> None:
        work, end = run.work, run.end
        if run.unstorable is not None and reply == "ended":
            self.metrics.writes_unstorable.inc()
            self._ended(work, Status.FAILED, storable(run.unstorable))
            self.fenced.report(work)  # a run still in the engine goes: its job has ended
        elif reply == "ended":
            self._ended(work, end.status, end.error)
        elif reply == "released":
            self.held.discard(work)
            event(log, "job.released", job=work.id, queue=work.queue)
        elif reply == "fenced":
            self.metrics.writes_fenced.inc()
            self.held.discard(work)
            self.fenced.report(work)
            event(log, "write.fenced", logging.WARNING, job=work.id, attempt=work.attempt, ops=len(run.ops),
                  end=type(end).__name__.strip("_").lower() if end is not None else None)
        elif reply == "ended_before":
            self.held.discard(work)
            if end is None:
                self.fenced.report(work)
            event(log, "job.already_ended", logging.DEBUG, job=work.id)

    def _ended(self, work: Work, status: Status, error: str | None) -> None:
        self.held.discard(work)
        self.metrics.job_ended(status.value)
        event(log, "job.ended", job=work.id, status=status.value, queue=work.queue, attempt=work.attempt, error=error or None)

    def _dead_letter(self, run: _RunWrite, reply: Exception, now: float) -> None:
        """Last resort for a run whose job cannot even be failed (its hash is not a hash)."""
        work = run.work
        error = storable(f"the worker could not store this job's output ({run.unstorable}) nor fail it ({reply})")
        try:
            self.scripts.dead(self.client, queue=work.queue, entry_id=work.entry_id, raw="", error=error, now=now,
                              code=ErrorCode.UNSTORABLE_OUTPUT, shard=self.keys.shard_of(work.id))
        except redis.RedisError as exc:
            event(log, "write.lost", logging.CRITICAL, job=work.id, error=error, dead_letter_error=str(exc))
        self.metrics.dead_lettered.inc()
        self.held.discard(work)
        self.fenced.report(work)
        event(log, "job.dead_lettered", logging.ERROR, job=work.id, queue=work.queue, error=error)

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


def _delta_args(delta: TokenDelta) -> tuple[str, str, str, str, str, str, str]:
    fields = delta.to_fields()
    # NOTE: the step loop gives every delta its offset (worker/outputs.py); 0 only for one made by hand
    return (fields["index"], fields.get("offset", "0"), fields["text"], fields["token_ids"],
            fields.get("finish_reason", ""), fields.get("logprobs", ""), fields.get("prompt", ""))
