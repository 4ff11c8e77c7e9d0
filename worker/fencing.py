"""Runs this worker lost: the writer or the heartbeat found the job owned by another run, or
ended under it, and the step loop drops them from the engine without writing anything."""

from __future__ import annotations

import threading

from worker.admission import Work


class Fenced:
    """Thread-safe hand-off of lost runs from the Redis-facing threads to the step loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[Work] = []

    def report(self, work: Work) -> None:
        with self._lock:
            self._works.append(work)

    def take(self) -> list[Work]:
        with self._lock:
            works, self._works = self._works, []
            return works
