"""A job's status (its hash's ``status`` field) and the one set of terminal statuses.

``TERMINAL_STATUSES`` is the only spelling of which statuses end a job: the Lua scripts'
``is_terminal`` and the cancel script's test for a job still live are generated from it
(``producers/protocol/scripts.py``), and Python code asks ``Status.terminal``.
"""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED, Status.EXPIRED})
# The statuses of a job not yet ended; members compare and hash as their values, so a status
# read from Redis as text is tested with ``in`` directly.
LIVE_STATUSES = frozenset(status for status in Status if not status.terminal)
