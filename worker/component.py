"""The start/stop base of the worker's Redis-facing components: a thread, a tick, a backoff."""

from __future__ import annotations

import logging
import random
import threading

import redis

from worker.logs import event

log = logging.getLogger(__name__)

# Errors that mean "Redis is not reachable right now": retry with backoff, lose nothing.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ConnectionError)


class Backoff:
    """Exponential backoff with jitter, from ``first`` to ``cap`` seconds."""

    def __init__(self, first: float = 0.05, cap: float = 5.0) -> None:
        self.first = first
        self.cap = cap
        self.delay = first

    def reset(self) -> None:
        self.delay = self.first

    def wait(self, stop: threading.Event) -> bool:
        """Sleep one step (cut short by ``stop``); True if still running."""
        stopped = stop.wait(self.delay * random.uniform(0.5, 1.0))
        self.delay = min(self.cap, self.delay * 2)
        return not stopped


class Component:
    """A daemon thread that calls ``tick()`` every ``interval`` seconds until stopped.

    A Redis outage inside ``tick`` is logged once and retried with backoff; any other error
    is logged with its traceback and retried the same way, so the thread never dies.
    """

    name = "component"

    def __init__(self, interval: float = 0.0) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.redis_up = True

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"sluiceway-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to stop and wait up to ``timeout`` for it (0: do not wait)."""
        self._stop.set()
        if self._thread is not None:
            if timeout:
                self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def tick(self) -> None:
        raise NotImplementedError

    def on_redis_down(self) -> None:
        """Called when a tick lost Redis (before the backoff)."""

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                self.tick()
            except REDIS_DOWN as exc:
                if self.redis_up:
                    event(log, "redis.unavailable", logging.WARNING, component=self.name, error=str(exc))
                self.redis_up = False
                self.on_redis_down()
                backoff.wait(self._stop)
                continue
            except Exception:
                event(log, "component.error", logging.ERROR, exc_info=True, component=self.name)
                backoff.wait(self._stop)
                continue
            if not self.redis_up:
                event(log, "redis.reconnected", component=self.name)
                self.redis_up = True
            backoff.reset()
            if self.interval:
                self._stop.wait(self.interval)
