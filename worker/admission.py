"""The one admission path: ingress sources hand ``Work`` in, the step loop takes it out.

A source (the Redis queue reader; later a Celery consumer) waits for ``room()``, offers
``Work`` whose ``sink`` knows how to publish that job's deltas and store its end, and may
ask to cancel a job. The step loop sets the capacity the engine has, takes work, and hands
results to ``work.sink`` -- it never knows which source a job came from.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from producers.protocol import Job, JobResult, Status, TokenDelta


class Sink(Protocol):
    """Where a source wants a job's output to go. Every method must return at once."""

    def publish(self, work: "Work", deltas: list[TokenDelta]) -> None: ...

    def finish(self, work: "Work", status: Status, result: JobResult | None = None, error: str | None = None) -> None: ...

    def release(self, work: "Work") -> None: ...


@dataclass(eq=False)
class Work:
    """One job taken by this worker, from the moment a source reads it until it ends."""

    job: Job
    sink: Sink
    queue: str | None = None  # the source's queue name
    entry_id: str | None = None  # the source's handle on the delivery (a stream entry id)
    enqueued_at: float | None = None  # unix seconds
    started_at: float = 0.0  # unix seconds: taken by this worker
    attempt: int = 1
    # Filled in by the step loop.
    admitted_at: float | None = None
    first_token_at: float | None = None
    streamed_to_end: set[int] = field(default_factory=set)  # completions whose last delta went out

    @property
    def id(self) -> str:
        return self.job.id


class Admission:
    """Thread-safe hand-off between sources (producers of work) and the step loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: deque[Work] = deque()
        self._cancels: dict[str, str] = {}  # job id -> why
        self._capacity = 0
        self._open = True

    # --- source side --------------------------------------------------------------------------
    def room(self) -> int:
        """Jobs the engine could take now, less those already handed in and not yet taken."""
        with self._cond:
            return max(0, self._capacity - len(self._ready)) if self._open else 0

    def wait_for_room(self, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._open and self._capacity > len(self._ready), timeout)
            return max(0, self._capacity - len(self._ready)) if self._open else 0

    def offer(self, works: list[Work]) -> bool:
        """Hand ``works`` to the step loop; False (nothing taken) once admission is closed."""
        with self._cond:
            if not self._open:
                return False
            self._ready.extend(works)
            self._cond.notify_all()
            return True

    def cancel(self, job_id: str, reason: str) -> None:
        with self._cond:
            self._cancels.setdefault(job_id, reason)
            self._cond.notify_all()

    @property
    def open(self) -> bool:
        return self._open

    # --- step-loop side -----------------------------------------------------------------------
    def set_capacity(self, capacity: int) -> None:
        with self._cond:
            grew = capacity > self._capacity
            self._capacity = capacity
            if grew:
                self._cond.notify_all()

    def take(self, limit: int) -> list[Work]:
        with self._cond:
            n = min(limit, len(self._ready))
            self._capacity = max(0, self._capacity - n)  # taken work fills room until the next set_capacity
            return [self._ready.popleft() for _ in range(n)]

    def take_cancels(self) -> dict[str, str]:
        with self._cond:
            cancels, self._cancels = self._cancels, {}
            return cancels

    def wait_for_work(self, timeout: float) -> None:
        """Block until work or a cancel arrives, or ``timeout`` passes."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._cancels, timeout)

    def close(self) -> list[Work]:
        """Stop accepting; return the work handed in and not yet taken."""
        with self._cond:
            self._open = False
            left = list(self._ready)
            self._ready.clear()
            self._cond.notify_all()
            return left


class Held:
    """The deliveries one source holds (read and not yet acknowledged), by job id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: dict[str, Work] = {}

    def add(self, work: Work) -> bool:
        """Hold ``work``; False if this job is already held (a second delivery of it)."""
        with self._lock:
            if work.id in self._works:
                return False
            self._works[work.id] = work
            return True

    def get(self, job_id: str) -> Work | None:
        with self._lock:
            return self._works.get(job_id)

    def discard(self, work: Work) -> None:
        with self._lock:
            if self._works.get(work.id) is work:
                del self._works[work.id]

    def snapshot(self) -> list[Work]:
        with self._lock:
            return list(self._works.values())

    def __contains__(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._works

    def __len__(self) -> int:
        with self._lock:
            return len(self._works)
