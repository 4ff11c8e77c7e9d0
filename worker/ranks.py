"""Ranks inside the engine: the job's queue (the worker's queue order), then its ``priority``.

The engine knows priorities only (``engine/core/ranking.py``: higher first, and higher
preempts lower). The worker folds the queue into that one integer: each queue is a band of
priorities wider than every priority the protocol admits, the first queue of ``--queues``
the highest band, so any job of ``interactive`` outranks any job of ``bulk`` and within a
queue the job's own ``priority`` decides.
"""

from __future__ import annotations

from producers.protocol.limits import MAX_INT_DIGITS
from worker.admission import Work

# every priority a job can carry lies strictly inside (-10**MAX_INT_DIGITS, 10**MAX_INT_DIGITS)
BAND = 2 * 10**MAX_INT_DIGITS


class Ranks:
    """The engine priority of a job from its queue's place in ``queues`` and its priority."""

    def __init__(self, queues: tuple[str, ...]) -> None:
        self.bands = {queue: len(queues) - 1 - i for i, queue in enumerate(queues)}

    def engine_priority(self, work: Work) -> int:
        # NOTE: a job from a source outside the queue list (the Celery ingress) ranks with the
        # lowest queue: Celery apps are batch callers far more often than interactive ones.
        return self.bands.get(work.queue, 0) * BAND + work.job.priority

    def key(self, work: Work) -> int:
        """Higher runs first."""
        return self.engine_priority(work)
