"""A producer's look at the workers before it enqueues a job of a later protocol revision.

A job that gives a field of revision R (``producers.protocol.revisions.job_needs``) is refused
(``RevisionNotSpoken``) when its queue has a live worker that does not speak R: any live worker
of the queue may take it, and one of an older revision fails it ``invalid_job``. With no live
worker it is enqueued, for the workers that come later. The heartbeats are read as the gateway
reads them (``producers.heartbeats``).
The heartbeats are read at most every ``READ_EVERY_S``, and only for such a job: a plain one
costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from producers.errors import RevisionNotSpoken
from producers.heartbeats import read_fleet
from producers.protocol import Job, Need, job_needs
from producers.protocol.revisions import Spoken, unmet, unmet_message

READ_EVERY_S = 2.0  # how stale the producer's view of the workers' revisions may be


class WorkerRevisions:
    """The revisions the live workers of each queue speak, from their heartbeats."""

    def __init__(self) -> None:
        self._spoken: dict[str, Spoken] = {}  # a queue with a live worker -> what its live workers speak
        self._read_at = float("-inf")

    def stale(self) -> bool:
        return time.monotonic() - self._read_at > READ_EVERY_S

    def read(self, records: dict[str, str]) -> None:
        """Take the ``{prefix}:workers`` hash as read; a record that is not a heartbeat is skipped."""
        self._spoken = read_fleet(records).spoken()
        self._read_at = time.monotonic()

    def check(self, need: Need, queue: str) -> None:
        """``RevisionNotSpoken`` naming the field when a live worker of ``queue`` does not speak
        ``need``'s revision."""
        spoken = self._spoken.get(queue)
        if unmet(need, spoken):
            message = unmet_message(need, spoken, f"live workers of queue {queue!r}")
            raise RevisionNotSpoken(f"{need.field}: {message}", need.field, need.revision, spoken.oldest)

    def check_all(self, needs: list[tuple[int, Need, str]], first: int | None) -> None:
        """``check`` each of ``needing``'s jobs; the refusal names the job's position from ``first``
        (None: one job, named by its field alone)."""
        for index, need, queue in needs:
            try:
                self.check(need, queue)
            except RevisionNotSpoken as exc:
                raise exc if first is None else exc.at(first + index) from None


def needing(jobs: Iterable[tuple[Job, str]]) -> list[tuple[int, Need, str]]:
    """The jobs (each with its queue) that give a field of a later revision: their position, need and queue."""
    return [(i, need, queue) for i, (job, queue) in enumerate(jobs) if (need := job_needs(job)) is not None]
