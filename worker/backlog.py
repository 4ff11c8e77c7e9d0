"""The backlog monitor: how deep the queues are, for the metrics and the swap-pool policy.

Because finishing a job deletes its entry, a stream's length is the jobs not yet finished:
``waiting = XLEN - pending`` are not yet taken by any worker, ``pending`` are held by one.

The Celery queue counts too, as ``celery:<queue>``: its tasks are read off the broker the way
kombu's Redis transport stores them, without consuming any (``CeleryQueueDepth``).

A queue's waiting jobs are shared among the live workers that read it, read from the heartbeats'
``queues`` as every producer reads them (``producers.heartbeats``): a worker of another model on
another queue takes none of them, and neither a draining worker (it takes no more jobs) nor a
record that is no heartbeat counts. The Celery queue's tasks are shared the same way among the
live workers whose heartbeat's ``celery_queue`` names it.
"""

from __future__ import annotations

import json
import math
import threading
from fractions import Fraction

import redis

from producers.heartbeats import read_fleet
from producers.protocol import CONSUMER_GROUP, Keys
from worker.admission import Held
from worker.component import REDIS_DOWN, Component
from worker.metrics import Metrics


class CeleryQueueDepth:
    """A Celery queue's (waiting, pending) on its Redis broker, read without taking a task.

    Kombu's Redis transport keeps a queue as Redis lists: the queue's name for priority 0 and
    ``<name><sep><step>`` for the higher priority steps. A task a consumer has taken and not yet
    acknowledged sits in one hash (``unacked``) shared by every queue of that database, as JSON
    ``[message, exchange, routing_key]``; Celery routes a queue's tasks with the queue's name as
    routing key, which is how this queue's are told apart.
    """

    def __init__(self, client: redis.Redis, queue: str) -> None:
        from kombu.transport.redis import Channel  # NOTE: kombu's own defaults, as the ingress consumes with them

        self.client = client
        self.queue = queue
        self.label = f"celery:{queue}"
        self.lists = [queue] + [f"{queue}{Channel.sep}{step}" for step in Channel.priority_steps if step]
        self.unacked_key = Channel.unacked_key

    def read(self) -> tuple[int, int]:
        pipe = self.client.pipeline(transaction=False)
        for key in self.lists:
            pipe.llen(key)
        pipe.hvals(self.unacked_key)
        *lengths, unacked = pipe.execute(raise_on_error=False)
        waiting = sum(n for n in lengths if isinstance(n, int))
        pending = 0 if isinstance(unacked, Exception) else sum(1 for raw in unacked if self._ours(raw))
        return waiting, pending

    def _ours(self, raw: bytes | str) -> bool:
        try:
            return json.loads(raw)[2] == self.queue
        except (ValueError, TypeError, IndexError, KeyError):
            return False


class BacklogMonitor(Component):
    """Every ``interval`` seconds, read each queue's depth and the live workers that share it."""

    name = "backlog"

    def __init__(self, client: redis.Redis, keys: Keys, queues: tuple[str, ...], held: Held, metrics: Metrics,
                 interval: float = 1.0, celery: CeleryQueueDepth | None = None) -> None:
        super().__init__(interval)
        self.client = client
        self.keys = keys
        self.queues = queues
        self.held = held
        self.metrics = metrics
        self.celery = celery
        self._lock = threading.Lock()
        self._depth: dict[str, tuple[int, int]] = {}
        self._sharers: dict[str, int] = {}  # queue (or the Celery label) -> live workers that take its jobs

    def tick(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        streams = [(queue, key) for queue in self.queues for key in self.keys.queue_streams(queue)]
        for _, key in streams:
            pipe.xlen(key)
            pipe.xpending(key, CONSUMER_GROUP)
        pipe.hgetall(self.keys.workers)
        replies = pipe.execute(raise_on_error=False)
        depth = {queue: (0, 0) for queue in self.queues}
        for i, (queue, _) in enumerate(streams):  # a queue's shards add up
            length, pending = replies[2 * i], replies[2 * i + 1]
            length = 0 if isinstance(length, Exception) else length
            pending = 0 if isinstance(pending, Exception) else pending["pending"]
            waiting, held = depth[queue]
            depth[queue] = (waiting + max(0, length - pending), held + pending)
        if self.celery is not None:
            depth[self.celery.label] = self._celery_depth()
        fleet = read_fleet({} if isinstance(replies[-1], Exception) else replies[-1])
        readers = fleet.readers()
        # NOTE: at least this worker, whose heartbeat may not be written yet
        sharers = {queue: max(1, readers.get(queue, 0)) for queue in self.queues}
        if self.celery is not None:
            consumers = fleet.celery_readers()
            # NOTE: when no live heartbeat names a Celery queue (a fleet of workers from before
            # ``celery_queue``), who consumes it is not known: its tasks are shared among every live
            # worker, as before. A fleet part old, part new counts only the workers that say; the
            # old ones that consume it too make this worker's share larger than it is, until they
            # are upgraded.
            consuming = consumers.get(self.celery.queue, 0) if consumers else fleet.live()
            sharers[self.celery.label] = max(1, consuming)
        with self._lock:
            self._depth = depth
            self._sharers = sharers
        self.metrics.observe_backlog(depth)

    def _celery_depth(self) -> tuple[int, int]:
        try:
            return self.celery.read()
        except REDIS_DOWN:
            if self.celery.client is self.client:
                raise
            # NOTE: a broker of its own (--celery-broker) that is down keeps its last depth; the
            # ingress reports the outage, and the stream queues are still read.
            with self._lock:
                return self._depth.get(self.celery.label, (0, 0))

    def depth(self) -> dict[str, tuple[int, int]]:
        """Queue -> (waiting, pending), as of the last read."""
        with self._lock:
            return dict(self._depth)

    def share(self) -> int:
        """This worker's share of the backlog: the jobs it holds plus its part of the waiting ones,
        each queue's waiting jobs divided by the live workers that read it."""
        with self._lock:
            waiting = sum(Fraction(w, self._sharers.get(queue, 1)) for queue, (w, _) in self._depth.items())
        # NOTE: the parts of several queues add up before rounding up, so a worker of two queues
        # with half a job of each counts one, not two
        return len(self.held) + math.ceil(waiting)
