"""The queue reader: takes jobs from the Redis streams into admission, never more than fit.

Each round reads at most ``admission.room()`` entries -- what the engine can take now --
in this order of preference:

1. this consumer's own pending entries (``XREADGROUP ... 0``): what a previous process of
   the same name held when it died, or what a lost reply delivered without our seeing it;
2. entries idle longer than ``--claim-idle-seconds`` in any consumer (``XAUTOCLAIM``): jobs
   of a dead worker (live workers heartbeat theirs, so theirs never go idle);
3. new entries, queue by queue in priority order (``XREADGROUP ... >``), blocking briefly
   only when every queue is empty; the last ``top_queue_reserve`` of the room is for the
   first queue alone, so an interactive job is read even when bulk work fills the engine
   (and a later queue gives at most ``LATER_QUEUE_BATCH`` entries a round).

Every entry is validated; garbage is failed (when an id can be read) and dead-lettered;
a valid job is started by the ``START`` script, which also settles jobs that already
ended, were cancelled while queued, or ran out of attempts.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from producers.protocol import CONSUMER_GROUP, HASH_FIELD, ErrorCode, Job, Keys, ProtocolError, Status, check_job_id
from worker import resume
from worker.admission import Admission, Held, Sink, Work
from worker.component import Component, RedisBusy, is_transient
from worker.entries import as_text, entry_time, parse_entry, raw_entry, readable_id
from worker.logs import event
from worker.metrics import Metrics
from worker.intake_reads import LATER_QUEUE_BATCH, StreamReads  # noqa: F401 (LATER_QUEUE_BATCH: the reader's rule)
from producers.connection import is_cluster_client
from worker.waits import BlockingReader, ShardWaiter
from worker.scripts import RELEASE_IDLE_MS, Scripts, storable

log = logging.getLogger(__name__)

# NOTE: how long a read waits on empty queues. The wait runs on a connection of its own, which
# a stop releases at once (CLIENT UNBLOCK), so the length costs no stop time; a wait also ends
# early for the next claim round. At 100 ms (with a non-blocking read per queue before each
# wait) an idle worker cost Redis ~18 commands a second: `sluiceway bench fleet`, docs/SCALING.md.
BLOCK_MS = 2000
# NOTE: how long the reader waits for a step's launch to end before it parses a later queue's
# entry; past it the batch's other entries wait for a later round, which reads the first queue first
PARSE_WAIT_S = 0.002


class RedisIntake(StreamReads, Component):
    """Reads the queue streams into ``admission`` as ``Work`` whose sink is ``sink``."""

    name = "intake"

    def __init__(self, client: redis.Redis, keys: Keys, queues: tuple[str, ...], scripts: Scripts,
                 admission: Admission, held: Held, sink: Sink, metrics: Metrics, *, claim_idle_seconds: float,
                 max_attempts: int, result_ttl: int, block_ms: int = BLOCK_MS, top_queue_reserve: int = 0,
                 launch_lock: threading.RLock | None = None) -> None:
        super().__init__()
        self.client = client
        self.keys = keys
        self.queues = queues
        self.scripts = scripts
        self.consumer = scripts.worker
        self.admission = admission
        self.held = held
        self.sink = sink
        self.metrics = metrics
        self.claim_idle_ms = int(claim_idle_seconds * 1000)
        self.claim_every_s = min(5.0, max(0.05, claim_idle_seconds / 4))
        self.max_attempts = max_attempts
        self.result_ttl = result_ttl
        self.block_ms = block_ms
        self.top_queue_reserve = top_queue_reserve  # room only the first queue's jobs take
        # the engine's (``EngineLike.launch_lock``): taken around the parse of each entry of a later
        # queue (``take``)
        self.launch_lock = launch_lock if launch_lock is not None else threading.RLock()
        # later queues' entries read but not parsed yet, a launch having held the lock: (queue, shard, entries)
        self._deferred: list[tuple[str, int | None, list]] = []
        self._waiter = BlockingReader(client)
        # the cluster layout on a Redis Cluster: a wait per shard, on its master
        self._shard_waiter = ShardWaiter(client) if keys.shards and is_cluster_client(client) else None
        self._queues_empty = False  # the last wait found nothing: wait again without the per-queue reads
        self._groups_ready = False
        # every stream read, (queue, shard, key), in priority order: one per queue, or one per
        # queue and shard in the cluster layout
        self.streams = [(q, shard, keys.queue(q, shard)) for q in queues for shard in keys.shard_range()]
        self._stream_of = {key: (q, shard) for q, shard, key in self.streams}
        self._own_cursor: dict[str, str | None] | None = None  # set while re-reading our own pending entries
        self._claim_cursor = {key: "0-0" for _, _, key in self.streams}
        self._next_claim_at = 0.0
        self.recover_own_pending()

    def recover_own_pending(self) -> None:
        """Re-read this consumer's pending entries before anything new (start, reconnect)."""
        self._own_cursor = {key: "0" for _, _, key in self.streams}

    def on_redis_down(self) -> None:
        self._groups_ready = False
        self._queues_empty = False
        self._deferred.clear()  # pending to this consumer: read again with the rest
        self.recover_own_pending()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._waiter.interrupt()  # a wait on empty queues ends now, not when it times out
        if self._shard_waiter is not None:
            self._shard_waiter.interrupt()
        super().stop(timeout)
        if self._thread is None:
            self._hand_back_deferred()
            self._waiter.close()
            if self._shard_waiter is not None:
                self._shard_waiter.close()

    def on_redis_busy(self) -> None:
        self._deferred.clear()
        self.recover_own_pending()

    def ensure_groups(self) -> None:
        """Create group ``workers`` at the start of each stream (MKSTREAM), so entries pushed
        before any worker ran are consumed too."""
        for _, _, key in self.streams:
            try:
                self.client.xgroup_create(key, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    # --- one round ------------------------------------------------------------------------------
    def tick(self) -> None:
        room = self.admission.wait_for_room(timeout=0.25)
        if room <= 0:
            if not self.admission.open:  # closed: nothing to read until stopped
                self._stop.wait(0.25)
            return
        if not self._groups_ready:
            self.ensure_groups()
        try:
            if self._deferred:  # NOTE: the first queue first: its jobs never wait behind a deferred batch
                batches = self._read_first_queue(room - sum(len(entries) for _, _, entries in self._deferred))
                batches.append(self._deferred.pop(0))
            elif self._own_cursor is not None:
                batches = self._read_own_pending(room)
            elif time.monotonic() >= self._next_claim_at:
                batches = self._claim_idle(room)
            else:
                batches = self._read_new(room)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            event(log, "intake.group_missing", logging.WARNING, error=str(exc))
            self._groups_ready = False  # the stream or group vanished (a Redis without persistence restarted)
            return
        for queue, shard, entries in batches:
            self.take(queue, entries, shard)

    # --- validate, start, offer -----------------------------------------------------------------------
    def take(self, queue: str, entries: list, shard: int | None = None) -> None:
        """Validate and start ``entries`` of ``queue`` (read from its ``shard`` stream in the
        cluster layout); offer the started ones to admission.

        NOTE: whatever one entry raises or is answered, only that entry is failed (and
        dead-lettered) or retried: the others of the batch start all the same."""
        if not self.admission.open:  # read just as the worker began to stop: hand back untouched
            self._hand_back(queue, [as_text(e) for e, _ in entries if e is not None], shard)
            return
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        settling: list[_Entry] = []
        # NOTE: an entry of a later queue is parsed (~0.75 ms of Python a 4,096-token prompt) only
        # while no step is scheduled or launched: a bulk backlog read at a run's start made those
        # steps 4-5x longer (engine.launched.under_launch_lock). A launch that goes on past
        # PARSE_WAIT_S leaves the rest of the batch to a later round, which reads the first queue
        # before it. The first queue's entries are small and urgent, and the express lane admits
        # them in the middle of a long launch: they are parsed at once.
        later = queue != self.queues[0]
        for n, (entry_id, fields) in enumerate(entries):
            if entry_id is None:
                continue
            entry = _Entry(as_text(entry_id), raw_entry(fields))
            if later and not self.launch_lock.acquire(timeout=PARSE_WAIT_S):
                self._deferred.append((queue, shard, entries[n:]))
                break
            try:
                self._queue_entry(pipe, queue, entry, fields, now, shard)
            except Exception as exc:
                event(log, "intake.entry_error", logging.ERROR, exc_info=True, queue=queue, entry=entry.entry_id)
                entry.job, entry.job_id = None, self._own_id(self.submitted_id(fields) or readable_id(fields), shard)
                self._queue_failure(pipe, queue, entry, f"invalid job: the worker could not read it: "
                                                        f"{type(exc).__name__}: {exc}", now, shard=shard)
            finally:
                if later:
                    self.launch_lock.release()
            if entry.reply_index is not None:
                settling.append(entry)
        replies = pipe.execute(raise_on_error=False) if len(pipe) else []
        works, broken, busy = [], [], 0
        for entry in settling:
            reply = replies[entry.reply_index]
            if isinstance(reply, Exception):
                if is_transient(reply):
                    busy += 1
                else:
                    broken.append((entry, reply))
                continue
            try:
                work = self._started(queue, entry, reply, now)
            except Exception:
                event(log, "intake.reply_error", logging.ERROR, exc_info=True, queue=queue, entry=entry.entry_id)
                continue
            if work is not None:
                works.append(work)
        busy += self._fail_broken(queue, broken, now, shard)
        resume.from_streams(self.client, self.keys, works)
        if works and not self.admission.offer(works):
            for work in works:  # admission closed while we read: give them back
                work.sink.release(work)
        if busy:
            # NOTE: a transient error (out of memory, loading, a failover) is never a reason to end
            # a job: the entries stay pending here and are read again after a backoff.
            raise RedisBusy(f"{busy} entries of {queue} to start again")

    def _queue_entry(self, pipe, queue: str, entry: "_Entry", fields: dict, now: float,
                     shard: int | None = None) -> None:
        """Queue the one command that settles ``entry``; its reply index goes on ``entry``."""
        stream = self.keys.queue(queue, shard)
        if not fields:  # deleted from the stream while pending
            pipe.xack(stream, CONSUMER_GROUP, entry.entry_id)
            return
        submitted = self.submitted_id(fields)
        try:
            job = parse_entry(fields)
            if submitted is not None and job.id != submitted:
                raise ProtocolError(f"id: {job.id!r} is not the id the job was submitted under ({submitted!r})",
                                    submitted)
            if self.keys.shard_of(job.id) != shard:
                raise ProtocolError(f"id: job {job.id[:100]!r} belongs to shard {self.keys.shard_of(job.id)} of "
                                    f"{self.keys.shards}, not to shard {shard}, whose stream holds it", None)
        except ProtocolError as exc:
            # NOTE: the hash the submit script created is the one a client waits on: it is the one failed.
            entry.job_id = self._own_id(submitted or exc.job_id, shard)
            self._queue_failure(pipe, queue, entry, f"invalid job: {exc}", now, shard=shard)
            return
        held = self.held.get(job.id)
        if held is not None:
            if held.entry_id != entry.entry_id:  # another entry of a job we run
                pipe.xack(stream, CONSUMER_GROUP, entry.entry_id)
                pipe.xdel(stream, entry.entry_id)
            return
        entry.job, entry.job_id = job, job.id
        index = len(pipe)
        if job.deadline is not None and job.deadline <= now:
            self.scripts.finish(pipe, job_id=job.id, queue=queue, entry_id=entry.entry_id, status=Status.EXPIRED.value,
                                now=now, ttl=self.result_ttl, stream=job.stream, finish_reason=Status.EXPIRED.value,
                                code=ErrorCode.EXPIRED,
                                error=f"deadline {job.deadline:.3f} passed {now - job.deadline:.3f}s before the job started")
        else:
            self.scripts.start(pipe, job_id=job.id, queue=queue, entry_id=entry.entry_id, now=now,
                               enqueued_at=entry_time(entry.entry_id), max_attempts=self.max_attempts,
                               ttl=self.result_ttl, stream=job.stream, raw=entry.raw)
        entry.reply_index = index

    def _own_id(self, job_id: str | None, shard: int | None) -> str | None:
        """``job_id`` if its keys share the slot of the stream read (always in the single-node
        layout), else None: that job is not this entry's to fail."""
        return job_id if job_id is not None and self.keys.shard_of(job_id) == shard else None

    def _queue_failure(self, pipe, queue: str, entry: "_Entry", error: str, now: float,
                       code: ErrorCode = ErrorCode.INVALID_JOB, shard: int | None = None) -> None:
        """Fail the entry's job (when its id is known) and dead-letter the entry, in one script."""
        error = storable(error)
        index = len(pipe)
        if entry.job_id is not None:
            self.scripts.finish(pipe, job_id=entry.job_id, queue=queue, entry_id=entry.entry_id,
                                status=Status.FAILED.value, now=now, ttl=self.result_ttl, stream=False, error=error,
                                dead_raw=entry.raw, code=code)
        else:
            self.scripts.dead(pipe, queue=queue, entry_id=entry.entry_id, raw=entry.raw, error=error, now=now,
                              code=code, shard=shard)
        entry.reply_index, entry.job, entry.failure = index, None, error
        event(log, "job.dead_lettered", logging.WARNING, queue=queue, entry=entry.entry_id, job=entry.job_id,
              error=error)

    def submitted_id(self, fields: dict) -> str | None:
        """The id of the job hash the submit script created for this entry (its ``hash`` field),
        or None: an entry written another way, or by an older submit script."""
        raw = fields.get(HASH_FIELD.encode(), fields.get(HASH_FIELD))
        if raw is None:
            return None
        job_id = self.keys.job_id_of(as_text(raw))
        if job_id is None:
            return None
        try:
            return check_job_id(job_id)
        except ValueError:
            return None

    def _hand_back(self, queue: str, entry_ids: list[str], shard: int | None = None) -> None:
        """Leave entries pending but idle at once, so any live worker's next claim takes them."""
        if entry_ids:
            self.client.xclaim(self.keys.queue(queue, shard), CONSUMER_GROUP, self.consumer, 0, entry_ids,
                               idle=RELEASE_IDLE_MS, justid=True)
            event(log, "intake.handed_back", queue=queue, entries=len(entry_ids))

    def _hand_back_deferred(self) -> None:
        """Entries left unparsed when the reader stopped go to any live worker's next claim."""
        deferred, self._deferred = self._deferred, []
        for queue, shard, entries in deferred:
            try:
                self._hand_back(queue, [as_text(e) for e, _ in entries if e is not None], shard)
            except redis.RedisError as exc:  # NOTE: pending to this consumer still: claimed once idle
                event(log, "intake.hand_back_failed", logging.WARNING, queue=queue, entries=len(entries),
                      error=str(exc))

    def _fail_broken(self, queue: str, broken: list, now: float, shard: int | None = None) -> int:
        """Entries whose script failed for good (a key of the wrong type, say) would fail the same
        way at every claim: fail their job with the reason and dead-letter them, together; an
        entry whose job cannot even be failed is dead-lettered alone. Return how many met a
        transient error on the way (they are read again)."""
        busy = 0
        while broken:
            pipe = self.client.pipeline(transaction=False)
            for entry, exc in broken:
                if entry.failure is not None:  # failing the job failed too: a bare dead letter
                    entry.job_id = None
                entry.job = None
                self._queue_failure(pipe, queue, entry, f"the worker could not settle this entry: {exc}", now,
                                    ErrorCode.UNSTORABLE_OUTPUT, shard)
            replies = pipe.execute(raise_on_error=False)
            again = []
            for (entry, _), reply in zip(broken, replies):
                if isinstance(reply, Exception):
                    if is_transient(reply):
                        busy += 1
                    elif entry.job_id is not None:
                        again.append((entry, reply))
                    else:
                        event(log, "intake.entry_stuck", logging.CRITICAL, queue=queue, entry=entry.entry_id,
                              error=str(reply))
                else:
                    self._counted_failure(entry, reply)
            broken = again
        return busy

    def _counted_failure(self, entry: "_Entry", reply) -> None:
        if entry.job_id is not None and reply == 1:  # FINISH: 1 if it ended the job
            self.metrics.job_ended(Status.FAILED.value)
        self.metrics.dead_lettered.inc()

    def _started(self, queue: str, entry: "_Entry", reply, now: float) -> Work | None:
        job, entry_id = entry.job, entry.entry_id
        if entry.failure is not None:  # the job failed (or the entry was dead-lettered) at read time
            self._counted_failure(entry, reply)
            return None
        if job is None:  # an acknowledgement
            return None
        if not isinstance(reply, list):  # FINISH of a job expired before it started
            if reply == 1:
                self.metrics.job_ended(Status.EXPIRED.value)
            return None
        kind = as_text(reply[0])
        if kind == "start":
            work = Work(job=job, sink=self.sink, queue=queue, entry_id=entry_id, started_at=now,
                        attempt=int(as_text(reply[1])), enqueued_at=float(as_text(reply[2])))
            if len(reply) > 4:
                if not job.stream:
                    work.resume_token_ids = resume.from_checkpoint(job, as_text(reply[3]))
                work.stream_entries = int(as_text(reply[4]))
            self.held.add(work)
            return work
        if kind == "cancelled":
            self.metrics.job_ended(Status.CANCELLED.value)
        elif kind == "exhausted":
            self.metrics.job_ended(Status.FAILED.value)
            self.metrics.dead_lettered.inc()
        event(log, f"job.{kind}", logging.WARNING if kind == "exhausted" else logging.INFO,
              job=job.id, queue=queue, entry=entry_id, detail=as_text(reply[1]) or None)
        return None


@dataclass(eq=False)
class _Entry:
    """One entry of a batch being settled."""

    entry_id: str
    raw: str  # its fields as a dead letter keeps them
    job: Job | None = None  # the job to start or expire
    job_id: str | None = None  # the id read from it, when one could be
    failure: str | None = None  # why it was failed or dead-lettered at read time
    reply_index: int | None = None  # its command's place in the pipeline

