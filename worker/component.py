"""The start/stop base of the worker's Redis-facing components: a thread, a tick, a backoff."""

from __future__ import annotations

import logging
import random
import threading
import time

import redis

from worker.logs import event

log = logging.getLogger(__name__)

# Errors that mean "Redis is not reachable right now": retry with backoff, lose nothing.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ConnectionError)

# Error codes of replies that heal by waiting: out of memory under noeviction, loading the
# dataset, busy in a script, a replica or a failover in progress, a cluster resharding, a
# failed background save. NOTE: never a reason to end a job; its write is retried.
TRANSIENT_CODES = ("OOM", "LOADING", "BUSY", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MISCONF",
                   "NOREPLICAS", "NOMASTERLINK")


def is_transient(error: BaseException) -> bool:
    """True for a Redis error that a later retry of the same command may not meet."""
    # NOTE: NOSCRIPT: a cluster node lost the scripts (producers/scripting.py loads them again)
    if isinstance(error, (*REDIS_DOWN, redis.exceptions.OutOfMemoryError, redis.ReadOnlyError,
                          redis.exceptions.NoScriptError)):
        return True
    if not isinstance(error, redis.ResponseError):
        return False
    text = str(error)
    # A plain reply starts with its code; inside a script (Redis 6) the command's reply follows
    # "@user_script:N: -" in the script's error.
    return text.split(" ", 1)[0] in TRANSIENT_CODES or any(f"-{code} " in text for code in TRANSIENT_CODES)


class RedisBusy(redis.RedisError):
    """Raised by a tick that left work for later because Redis answered with a transient error."""


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


GATE_POLL_S = 0.05  # how often a gated component looks at its gate


class Component:
    """A daemon thread that calls ``tick()`` every ``interval`` seconds until stopped.

    A Redis outage inside ``tick`` is logged once (then again every ``still_down_log_s`` while
    it lasts, so an operator reading the log sees it go on) and retried with backoff, a transient error
    reply (``is_transient``) is logged and retried the same way, and any other error is logged
    with its traceback and retried too, so the thread never dies.
    """

    name = "component"
    still_down_log_s = 60.0
    backoff_cap_s = 5.0  # the longest wait between two tries while Redis is away

    def __init__(self, interval: float = 0.0) -> None:
        self.interval = interval
        # set: the component may tick; None: at once. A worker that started while Redis was away
        # holds the components that read jobs or write its record until its start checks pass.
        self.gate: threading.Event | None = None
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

    def on_redis_busy(self) -> None:
        """Called when a tick met a transient error reply (out of memory, loading, ...)."""

    def _run(self) -> None:
        backoff = Backoff(cap=self.backoff_cap_s)
        down_since = said_at = 0.0
        while not self._stop.is_set():
            if self.gate is not None and not self.gate.is_set():
                self._stop.wait(GATE_POLL_S)
                continue
            try:
                self.tick()
            except REDIS_DOWN as exc:
                now = time.monotonic()
                if self.redis_up:
                    event(log, "redis.unavailable", logging.WARNING, component=self.name, error=str(exc))
                    down_since = said_at = now
                elif now - said_at >= self.still_down_log_s:
                    event(log, "redis.still_unavailable", logging.WARNING, component=self.name,
                          down_s=round(now - down_since), error=str(exc))
                    said_at = now
                self.redis_up = False
                self.on_redis_down()
                backoff.wait(self._stop)
                continue
            except Exception as exc:
                if isinstance(exc, RedisBusy) or is_transient(exc):
                    event(log, "redis.busy", logging.WARNING, component=self.name, error=str(exc))
                    self.on_redis_busy()
                else:
                    event(log, "component.error", logging.ERROR, exc_info=True, component=self.name)
                backoff.wait(self._stop)
                continue
            if not self.redis_up:
                event(log, "redis.reconnected", component=self.name)
                self.redis_up = True
            backoff.reset()
            if self.interval:
                self._stop.wait(self.interval)
