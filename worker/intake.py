"""The queue reader: takes jobs from the Redis streams into admission, never more than fit.

Each round reads at most ``admission.room()`` entries -- what the engine can take now --
in this order of preference:

1. this consumer's own pending entries (``XREADGROUP ... 0``): what a previous process of
   the same name held when it died, or what a lost reply delivered without our seeing it;
2. entries idle longer than ``--claim-idle-seconds`` in any consumer (``XAUTOCLAIM``): jobs
   of a dead worker (live workers heartbeat theirs, so theirs never go idle);
3. new entries, queue by queue in priority order (``XREADGROUP ... >``), blocking briefly
   only when every queue is empty.

Every entry is validated; garbage is failed (when an id can be read) and dead-lettered;
a valid job is started by the ``START`` script, which also settles jobs that already
ended, were cancelled while queued, or ran out of attempts.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from producers.protocol import CONSUMER_GROUP, JOB_FIELD, Job, Keys, ProtocolError, Status, parse_job
from worker.admission import Admission, Held, Sink, Work
from worker.component import Component
from worker.logs import event
from worker.metrics import Metrics
from worker.scripts import RELEASE_IDLE_MS, Scripts

log = logging.getLogger(__name__)


def entry_time(entry_id: str) -> float:
    """Unix seconds at which Redis stored the entry (the first half of its id)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _text(value) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def raw_entry(fields: dict) -> str:
    """The entry's fields as a JSON object of strings (what a dead letter keeps)."""
    return json.dumps({_text(k): _text(v) for k, v in (fields or {}).items()}, ensure_ascii=False)


def parse_entry(fields: dict) -> Job:
    """The job of one stream entry; ``ProtocolError`` naming the bad field otherwise."""
    raw = fields.get(JOB_FIELD.encode(), fields.get(JOB_FIELD))
    if raw is None:
        names = ", ".join(sorted(_text(k) for k in fields)) or "none"
        raise ProtocolError(f"entry has no '{JOB_FIELD}' field (fields: {names})")
    return parse_job(raw)


class RedisIntake(Component):
    """Reads the queue streams into ``admission`` as ``Work`` whose sink is ``sink``."""

    name = "intake"

    def __init__(self, client: redis.Redis, keys: Keys, queues: tuple[str, ...], scripts: Scripts,
                 admission: Admission, held: Held, sink: Sink, metrics: Metrics, *, claim_idle_seconds: float,
                 max_attempts: int, result_ttl: int, block_ms: int = 500) -> None:
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
        self._groups_ready = False
        self._own_cursor: dict[str, str] | None = None  # set while re-reading our own pending entries
        self._claim_cursor = {q: "0-0" for q in queues}
        self._next_claim_at = 0.0
        self.recover_own_pending()

    def recover_own_pending(self) -> None:
        """Re-read this consumer's pending entries before anything new (start, reconnect)."""
        self._own_cursor = {q: "0" for q in self.queues}

    def on_redis_down(self) -> None:
        self._groups_ready = False
        self.recover_own_pending()

    def ensure_groups(self) -> None:
        """Create group ``workers`` at the start of each stream (MKSTREAM), so entries pushed
        before any worker ran are consumed too."""
        for queue in self.queues:
            try:
                self.client.xgroup_create(self.keys.queue(queue), CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    # --- one round ------------------------------------------------------------------------------
    def tick(self) -> None:
        room = self.admission.wait_for_room(timeout=0.25)
        if room <= 0:
            return
        if not self._groups_ready:
            self.ensure_groups()
        try:
            if self._own_cursor is not None:
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
        for queue, entries in batches:
            self.take(queue, entries)

    def _read_own_pending(self, room: int) -> list:
        cursor = self._own_cursor
        streams = {self.keys.queue(q): cursor[q] for q in self.queues if cursor[q] is not None}
        if not streams:
            self._own_cursor = None
            return []
        reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=room)
        batches = [(self._queue_of(key), entries) for key, entries in reply or [] if entries]
        for queue in self.queues:  # a queue that returned nothing has no more pending entries of ours
            last = next((entries[-1][0] for q, entries in batches if q == queue), None)
            cursor[queue] = _text(last) if last is not None else None
        return batches

    def _claim_idle(self, room: int) -> list:
        batches = []
        for queue in self.queues:
            if room <= 0:
                break
            reply = self.client.xautoclaim(self.keys.queue(queue), CONSUMER_GROUP, self.consumer,
                                           self.claim_idle_ms, start_id=self._claim_cursor[queue], count=room)
            cursor, entries = _text(reply[0]), reply[1]
            self._claim_cursor[queue] = cursor
            if entries:
                event(log, "intake.claimed", queue=queue, entries=len(entries))
                batches.append((queue, entries))
                room -= len(entries)
        if all(c == "0-0" for c in self._claim_cursor.values()):
            self._next_claim_at = time.monotonic() + self.claim_every_s
        return batches

    def _read_new(self, room: int) -> list:
        batches = []
        for queue in self.queues:
            if room <= 0:
                break
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.queue(queue): ">"}, count=room)
            for _, entries in reply or []:
                if entries:
                    batches.append((queue, entries))
                    room -= len(entries)
        if batches:
            return batches
        # NOTE: every queue is empty: wait on all of them at once, one entry each, then go back to
        # the priority-ordered reads; the wait is short so that claims and stops stay prompt.
        streams = {self.keys.queue(q): ">" for q in self.queues}
        reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=1, block=self.block_ms)
        return [(self._queue_of(key), entries) for key, entries in reply or [] if entries]

    def _queue_of(self, key) -> str:
        return _text(key).removeprefix(self.keys.queue(""))

    # --- validate, start, offer -----------------------------------------------------------------------
    def take(self, queue: str, entries: list) -> None:
        """Validate and start ``entries`` of ``queue``; offer the started ones to admission."""
        if not self.admission.open:  # read just as the worker began to stop: hand back untouched
            self._hand_back(queue, [_text(e) for e, _ in entries if e is not None])
            return
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        settling: list[tuple[int, str, str, Job | None]] = []  # (reply index, entry id, raw entry, job to start)
        for entry_id, fields in entries:
            if entry_id is None:
                continue
            entry_id = _text(entry_id)
            if not fields:  # deleted from the stream while pending
                pipe.xack(self.keys.queue(queue), CONSUMER_GROUP, entry_id)
                continue
            raw = raw_entry(fields)
            try:
                job = parse_entry(fields)
            except ProtocolError as exc:
                settling.append((len(pipe), entry_id, raw, None))
                self._dead_letter(pipe, queue, entry_id, raw, exc, now)
                continue
            held = self.held.get(job.id)
            if held is not None:
                if held.entry_id != entry_id:  # another entry of a job we run
                    pipe.xack(self.keys.queue(queue), CONSUMER_GROUP, entry_id)
                    pipe.xdel(self.keys.queue(queue), entry_id)
                continue
            settling.append((len(pipe), entry_id, raw, job))
            if job.deadline is not None and job.deadline <= now:
                self.scripts.finish(pipe, job_id=job.id, queue=queue, entry_id=entry_id, status=Status.EXPIRED.value,
                                    now=now, ttl=self.result_ttl, stream=job.stream, finish_reason="expired",
                                    error=f"deadline {job.deadline:.3f} passed {now - job.deadline:.3f}s before the job started")
            else:
                self.scripts.start(pipe, job_id=job.id, queue=queue, entry_id=entry_id, now=now,
                                   enqueued_at=entry_time(entry_id), max_attempts=self.max_attempts,
                                   ttl=self.result_ttl, stream=job.stream, raw=raw)
        replies = pipe.execute(raise_on_error=False) if len(pipe) else []
        works, broken = [], []
        for i, entry_id, raw, job in settling:
            if isinstance(replies[i], Exception):
                broken.append((entry_id, raw, replies[i]))
            elif job is not None and (work := self._started(queue, entry_id, job, replies[i], now)) is not None:
                works.append(work)
        self._dead_letter_broken(queue, broken, now)
        if works and not self.admission.offer(works):
            for work in works:  # admission closed while we read: give them back
                work.sink.release(work)

    def _hand_back(self, queue: str, entry_ids: list[str]) -> None:
        """Leave entries pending but idle at once, so any live worker's next claim takes them."""
        if entry_ids:
            self.client.xclaim(self.keys.queue(queue), CONSUMER_GROUP, self.consumer, 0, entry_ids,
                               idle=RELEASE_IDLE_MS, justid=True)
            event(log, "intake.handed_back", queue=queue, entries=len(entry_ids))

    def _dead_letter(self, pipe, queue: str, entry_id: str, raw: str, exc: ProtocolError, now: float) -> None:
        error = f"invalid job: {exc}"
        if exc.job_id is not None:
            self.scripts.finish(pipe, job_id=exc.job_id, queue=queue, entry_id=entry_id, status=Status.FAILED.value,
                                now=now, ttl=self.result_ttl, stream=False, error=error, dead_raw=raw)
            self.metrics.job_ended(Status.FAILED.value)
        else:
            self.scripts.dead(pipe, queue=queue, entry_id=entry_id, raw=raw, error=error, now=now)
        self.metrics.dead_lettered.inc()
        event(log, "job.dead_lettered", logging.WARNING, queue=queue, entry=entry_id, job=exc.job_id, error=error)

    def _dead_letter_broken(self, queue: str, broken: list[tuple[str, str, Exception]], now: float) -> None:
        """Entries whose script failed (a job key of the wrong type, say) would fail the same way
        at every claim: dead-letter them rather than retry them forever."""
        if not broken:
            return
        pipe = self.client.pipeline(transaction=False)
        for entry_id, raw, exc in broken:
            error = f"the worker could not settle this entry: {exc}"
            self.scripts.dead(pipe, queue=queue, entry_id=entry_id, raw=raw, error=error, now=now)
            self.metrics.dead_lettered.inc()
            event(log, "job.dead_lettered", logging.ERROR, queue=queue, entry=entry_id, error=error)
        pipe.execute(raise_on_error=False)

    def _started(self, queue: str, entry_id: str, job: Job, reply, now: float) -> Work | None:
        if not isinstance(reply, list):  # FINISH of a job expired before it started
            if reply == 1:
                self.metrics.job_ended(Status.EXPIRED.value)
            return None
        kind = _text(reply[0])
        if kind == "start":
            work = Work(job=job, sink=self.sink, queue=queue, entry_id=entry_id, started_at=now,
                        attempt=int(_text(reply[1])), enqueued_at=float(_text(reply[2])))
            self.held.add(work)
            return work
        if kind == "cancelled":
            self.metrics.job_ended(Status.CANCELLED.value)
        elif kind == "exhausted":
            self.metrics.job_ended(Status.FAILED.value)
            self.metrics.dead_lettered.inc()
        event(log, f"job.{kind}", logging.WARNING if kind == "exhausted" else logging.INFO,
              job=job.id, queue=queue, entry=entry_id, detail=_text(reply[1]) or None)
        return None
