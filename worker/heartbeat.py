"""The heartbeat: keeps this worker's jobs from looking abandoned, and announces the worker.

Every beat resets the idle time of each entry this worker holds (``XCLAIM ... JUSTID``
through the ``HEARTBEAT`` script, only for entries it still owns), so a generation longer
than ``--claim-idle-seconds`` is never claimed by another worker; and it rewrites this
worker's ``WorkerInfo`` in the ``{prefix}:workers`` hash for ``sluiceway status``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable

import redis

from producers.protocol import Keys, WorkerInfo
from worker import __version__
from worker.admission import Held
from worker.component import REDIS_DOWN, Component
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
                 describe: Callable[[], dict], base: WorkerInfo) -> None:
        super().__init__(interval)
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.held = held
        self.describe = describe
        self.base = base

    @classmethod
    def worker_info(cls, name: str, queues: tuple[str, ...], model: str, stale_after_s: float) -> WorkerInfo:
        now = time.time()
        return WorkerInfo(name=name, host=socket.gethostname(), pid=os.getpid(), queues=list(queues), model=model,
                          state="starting", started_at=now, last_seen=now, stale_after_s=stale_after_s,
                          version=__version__)

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
        by_queue: dict[str, list[str]] = defaultdict(list)
        for work in self.held.snapshot():
            if work.queue is not None and work.entry_id is not None:
                by_queue[work.queue].append(work.entry_id)
        pipe = self.client.pipeline(transaction=False)
        for queue, entry_ids in by_queue.items():
            self.scripts.heartbeat(pipe, queue=queue, entry_ids=entry_ids)
        info = self.base.model_copy(update={**self.describe(), "last_seen": time.time()})
        pipe.hset(self.keys.workers, info.name, info.model_dump_json())
        pipe.execute()

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        try:
            self.client.hdel(self.keys.workers, self.base.name)
        except REDIS_DOWN:
            pass  # the record goes stale on its own
