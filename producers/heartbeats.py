"""The workers' heartbeats (the ``{prefix}:workers`` hash), read one way by all who read them.

Every reader of the hash reads it through ``read_fleet``: the clients' revision check
(``producers.worker_revisions``), the gateway's model directory (``gateway/models.py``),
``Client.workers`` and ``Client.fleet`` (``sluiceway status``) and the worker's backlog monitor
(``worker/backlog.py``). So a record means the same to each: one that is not a heartbeat is
skipped (``Fleet.unreadable``), a worker runs while its heartbeat is fresh (``Heartbeat.fresh``)
and takes jobs while it is also not draining (``Heartbeat.live``), a queue's waiting jobs are
shared among the live workers that read it (``Fleet.readers``), a Celery queue's tasks among the
live workers that consume it (``Fleet.celery_readers``), and a queue reads a job of a
later protocol revision only if every live worker of it speaks that revision (``Fleet.spoken``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from producers.protocol import WorkerInfo
from producers.protocol.revisions import Spoken, spoken_by


@dataclass(frozen=True)
class Heartbeat:
    """One worker's record, read."""

    info: WorkerInfo
    fresh: bool  # its last beat is within its ``stale_after_s``: the worker runs (a stale one died)

    @property
    def live(self) -> bool:
        """It takes jobs from its queues: its heartbeat is fresh and it is not draining."""
        return self.fresh and self.info.state != "draining"


@dataclass(frozen=True)
class Fleet:
    """The workers' hash as read at one moment."""

    workers: list[Heartbeat]  # each record that is a heartbeat, in the order of its field's name
    unreadable: list[str]  # the fields whose record is not one (hand-written, or of another program)
    at: float  # when it was read (unix seconds): what ``fresh`` was decided against

    def live(self) -> int:
        """How many workers take jobs, from whatever queues."""
        return sum(1 for worker in self.workers if worker.live)

    def readers(self) -> dict[str, int]:
        """Each queue that has a live worker -> how many live workers read it (the ``queues`` of
        their heartbeats; a queue a worker names twice counts once)."""
        return {queue: len(workers) for queue, workers in self._by_queue().items()}

    def celery_readers(self) -> dict[str, int]:
        """Each Celery queue that has a live worker -> how many live workers consume it (the
        ``celery_queue`` of their heartbeats). Empty when no live heartbeat names one: then none
        consumes Celery, or the workers are from before the field and do not say."""
        return dict(Counter(worker.info.celery_queue for worker in self.workers
                            if worker.live and worker.info.celery_queue is not None))

    def spoken(self) -> dict[str, Spoken]:
        """Each queue that has a live worker -> the revisions its live workers speak.

        NOTE: every live worker of a queue counts, whatever model it serves: any of them may take
        the next job from the queue."""
        by_queue = self._by_queue().items()
        return {queue: spoken for queue, workers in by_queue
                if (spoken := spoken_by(worker.info.protocol for worker in workers))}

    def _by_queue(self) -> dict[str, list[Heartbeat]]:
        """Each queue that has a live worker -> its live workers (one named twice is one reader)."""
        by_queue: dict[str, list[Heartbeat]] = {}
        for worker in self.workers:
            if worker.live:
                for queue in dict.fromkeys(worker.info.queues):
                    by_queue.setdefault(queue, []).append(worker)
        return by_queue


def read_fleet(records: Mapping[str, str] | Mapping[bytes, bytes], now: float | None = None) -> Fleet:
    """The ``HGETALL`` of ``{prefix}:workers`` (str or bytes, as the client decodes), read at
    ``now`` (unix seconds; default: now)."""
    now = time.time() if now is None else now
    workers, unreadable = [], []
    for key in sorted(records):
        try:
            info = WorkerInfo.model_validate_json(records[key])
        except (ValidationError, ValueError):
            unreadable.append(key.decode(errors="replace") if isinstance(key, bytes) else key)
            continue
        workers.append(Heartbeat(info, info.alive(now)))
    return Fleet(workers, unreadable, now)
