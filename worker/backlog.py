"""The backlog monitor: how deep the queues are, for the metrics and the swap-pool policy.

Because finishing a job deletes its entry, a stream's length is the jobs not yet finished:
``waiting = XLEN - pending`` are not yet taken by any worker, ``pending`` are held by one.
"""

from __future__ import annotations

import math
import threading
import time

import redis

from producers.protocol import CONSUMER_GROUP, Keys, WorkerInfo
from worker.admission import Held
from worker.component import Component
from worker.metrics import Metrics


class BacklogMonitor(Component):
    """Every ``interval`` seconds, read each queue's depth and the number of live workers."""

    name = "backlog"

    def __init__(self, client: redis.Redis, keys: Keys, queues: tuple[str, ...], held: Held, metrics: Metrics,
                 interval: float = 1.0) -> None:
        super().__init__(interval)
        self.client = client
        self.keys = keys
        self.queues = queues
        self.held = held
        self.metrics = metrics
        self._lock = threading.Lock()
        self._depth: dict[str, tuple[int, int]] = {}
        self._live_workers = 1

    def tick(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for queue in self.queues:
            pipe.xlen(self.keys.queue(queue))
            pipe.xpending(self.keys.queue(queue), CONSUMER_GROUP)
        pipe.hvals(self.keys.workers)
        replies = pipe.execute(raise_on_error=False)
        depth = {}
        for i, queue in enumerate(self.queues):
            length, pending = replies[2 * i], replies[2 * i + 1]
            length = 0 if isinstance(length, Exception) else length
            pending = 0 if isinstance(pending, Exception) else pending["pending"]
            depth[queue] = (max(0, length - pending), pending)
        now = time.time()
        workers = [] if isinstance(replies[-1], Exception) else replies[-1]
        live = sum(1 for raw in workers if _alive(raw, now))
        with self._lock:
            self._depth = depth
            self._live_workers = max(1, live)
        self.metrics.observe_backlog(depth)

    def depth(self) -> dict[str, tuple[int, int]]:
        """Queue -> (waiting, pending), as of the last read."""
        with self._lock:
            return dict(self._depth)

    def share(self) -> int:
        """This worker's share of the backlog: the jobs it holds plus its part of the waiting ones."""
        with self._lock:
            waiting = sum(w for w, _ in self._depth.values())
            live = self._live_workers
        return len(self.held) + math.ceil(waiting / live)


def _alive(raw, now: float) -> bool:
    try:
        return WorkerInfo.model_validate_json(raw).alive(now)
    except ValueError:
        return False
