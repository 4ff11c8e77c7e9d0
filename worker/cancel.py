"""Cancellation and deadlines.

``CancelWatcher`` polls the cancel keys of the jobs this worker holds (one ``MGET`` per
round) and asks admission to cancel the ones a client flagged; a job cancelled while still
queued is settled by the ``START`` script instead. ``Deadlines`` is the step loop's heap
of job deadlines, so finding the expired ones costs nothing while none is due.
"""

from __future__ import annotations

import heapq
import logging
import math

import redis

from producers.protocol import Keys
from worker.admission import Admission, Held
from worker.component import Component
from worker.logs import event

log = logging.getLogger(__name__)


class CancelWatcher(Component):
    """Every ``interval`` seconds, turn set cancel keys of held jobs into cancel requests."""

    name = "cancel"

    def __init__(self, client: redis.Redis, keys: Keys, held: Held, admission: Admission, interval: float) -> None:
        super().__init__(interval)
        self.client = client
        self.keys = keys
        self.held = held
        self.admission = admission  # where cancels wait for the step loop, once each

    def tick(self) -> None:
        job_ids = [w.id for w in self.held.snapshot()]
        if not job_ids:
            return
        if self.keys.shards:  # NOTE: the cancel keys of the cluster layout live in many slots: one GET each, pipelined
            pipe = self.client.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.get(self.keys.cancel(job_id))
            flags = pipe.execute()
        else:
            flags = self.client.mget([self.keys.cancel(job_id) for job_id in job_ids])
        for job_id, flag in zip(job_ids, flags):
            if flag is not None and self.admission.cancel(job_id, "cancelled by a client"):
                event(log, "job.cancel_requested", job=job_id)


class Deadlines:
    """Job deadlines (unix seconds), earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._live: dict[str, float] = {}

    def add(self, job_id: str, deadline: float) -> None:
        """Track ``job_id``'s deadline; a value that is not a number, or NaN, is not tracked.

        NOTE: a NaN at the top of the heap would block every deadline below it (``NaN <= now``
        is false) and break the heap's order for the rest; the protocol refuses non-finite
        deadlines, and this keeps a bad value from ever reaching the heap all the same.
        """
        try:
            deadline = float(deadline)
        except (TypeError, ValueError):
            deadline = math.nan
        if math.isnan(deadline):
            event(log, "deadline.ignored", logging.WARNING, job=job_id, deadline=repr(deadline))
            return
        self._live[job_id] = deadline
        heapq.heappush(self._heap, (deadline, job_id))

    def discard(self, job_id: str) -> None:
        if self._live.pop(job_id, None) is not None and len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(d, j) for d, j in self._heap if self._live.get(j) == d]
            heapq.heapify(self._heap)

    def expired(self, now: float) -> list[str]:
        """Remove and return the jobs whose deadline is at or before ``now``."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            deadline, job_id = heapq.heappop(self._heap)
            if self._live.get(job_id) == deadline:
                del self._live[job_id]
                due.append(job_id)
        return due

    def __len__(self) -> int:
        return len(self._live)
