"""The heartbeat: keeps this worker's jobs from looking abandoned, and announces the worker.

Every beat resets the idle time of each entry this worker holds (``XCLAIM ... JUSTID``
through the ``HEARTBEAT`` script, only for runs it still owns: the entry is this consumer's
and the job hash names this run), so a generation longer than ``--claim-idle-seconds`` is
never claimed by another worker; and it rewrites this worker's ``WorkerInfo`` in the
``{prefix}:workers`` hash for ``sluiceway status``. A run the beat finds lost (another
worker took the job while this one was frozen) or ended is handed to the step loop, which
drops it from the engine.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable

import redis

from producers.protocol import PROTOCOL_REVISION, Keys, WorkerInfo
from worker import __version__
from worker.admission import Held, Work
from worker.component import REDIS_DOWN, Component
from worker.fencing import Fenced
from worker.logs import event
from worker.metrics import Metrics
from worker.scripts import Scripts

log = logging.getLogger(__name__)


class NameInUse(RuntimeError):
    """Another live worker uses this worker's name."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Heartbeat(Component):
    """Beats every ``interval`` seconds until stopped; removes the worker's record on stop."""

    name = "heartbeat"

    def __init__(self, client: redis.Redis, keys: Keys, scripts: Scripts, held: Held, interval: float,
                 describe: Callable[[], dict], base: WorkerInfo, *, fenced: Fenced | None = None,
                 metrics: Metrics | None = None) -> None:
        super().__init__(interval)
        self.fenced = fenced if fenced is not None else Fenced()
        self.metrics = metrics
        self._record_failing = False
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.held = held
        self.describe = describe
        self.base = base

    @classmethod
    def worker_info(cls, name: str, queues: tuple[str, ...], model: str, stale_after_s: float,
                    result_ttl_s: int | None = None, served_model_name: str | None = None,
                    celery_queue: str | None = None) -> WorkerInfo:
        now = time.time()
        return WorkerInfo(name=name, host=socket.gethostname(), pid=os.getpid(), queues=list(queues), model=model,
                          state="starting", started_at=now, last_seen=now, stale_after_s=stale_after_s,
                          version=__version__, protocol=PROTOCOL_REVISION, result_ttl_s=result_ttl_s,
                          served_model_name=served_model_name or model, celery_queue=celery_queue)

    def check_name_free(self) -> None:
        """Refuse a name a live worker holds: two consumers of one name would share their
        pending entries. A dead holder (stale record, or a dead pid on this host) is fine."""
        raw = self.client.hget(self.keys.workers, self.base.name)
        if raw is None:
            return
        try:
            other = WorkerInfo.model_validate_json(raw)
        except ValueError:
            return
        if not other.alive(time.time()) or other.pid == self.base.pid and other.host == self.base.host:
            return
        if other.host == self.base.host and not _pid_alive(other.pid):
            return
        raise NameInUse(
            f"name: worker name {other.name!r} is in use by a live worker on {other.host} (pid {other.pid},"
            f" seen {time.time() - other.last_seen:.0f}s ago); give each worker its own --name, or wait"
            f" {other.stale_after_s:.0f}s after that worker died"
        )

    def tick(self) -> None:
        # NOTE: one script per queue stream: per (queue, shard) in the cluster layout, whose
        # streams live in different slots
        by_queue: dict[tuple[str, int | None], list[Work]] = defaultdict(list)
        for work in self.held.snapshot():
            if work.queue is not None and work.entry_id is not None:
                by_queue[(work.queue, self.keys.shard_of(work.id))].append(work)
        pipe = self.client.pipeline(transaction=False)
        for (queue, _), works in by_queue.items():
            self.scripts.heartbeat(pipe, queue=queue, runs=[(w.id, w.entry_id, w.attempt) for w in works])
        info = self.base.model_copy(update={**self.describe(), "last_seen": time.time()})
        pipe.hset(self.keys.workers, info.name, info.model_dump_json())
        replies = pipe.execute(raise_on_error=False)
        failed = None
        for works, codes in zip(by_queue.values(), replies):
            if isinstance(codes, Exception):
                failed = codes  # retried at the next beat, after a backoff
                continue
            for work, code in zip(works, codes):
                if code < 0 and self.held.get(work.id) is work:
                    self._lost(work)
                elif code == 0 and self.held.get(work.id) is work:
                    self.fenced.report(work)  # ended under it (the writer settles what it still holds)
        if failed is not None:
            raise failed
        if isinstance(replies[-1], Exception):
            # NOTE: the beats went through; only the status record failed (out of memory, say).
            # No backoff for that: entries must stay fresh, and the record is rewritten next beat.
            if not self._record_failing:
                event(log, "heartbeat.record_failed", logging.WARNING, error=str(replies[-1]))
            self._record_failing = True
        else:
            self._record_failing = False

    def _lost(self, work: Work) -> None:
        """Another run owns the job now: stop keeping it, and let the step loop drop it."""
        self.held.discard(work)
        self.fenced.report(work)
        if self.metrics is not None:
            self.metrics.writes_fenced.inc()
        event(log, "write.fenced", logging.WARNING, job=work.id, attempt=work.attempt, ops=1, end="heartbeat")

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self.gate is not None and not self.gate.is_set():
            return  # NOTE: it never beat: the record under its name, if any, is another worker's
        try:
            self.client.hdel(self.keys.workers, self.base.name)
        except REDIS_DOWN:
            pass  # the record goes stale on its own
