"""A gateway's shutdown, bounded: nothing it waits on keeps the process from exiting."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection
from typing import Any

log = logging.getLogger("sluiceway.gateway")

STOP_WAIT_S = 5.0  # for each part of the shutdown: tasks to end after their cancel, a lease release, a close


async def bounded(work: Awaitable[Any], what: str) -> None:
    """Await ``work`` for at most ``STOP_WAIT_S`` at shutdown, then leave it (logged), failed or not.

    NOTE: not ``wait_for``: on its timeout that waits for the cancelled work to end, which a
    cancel stuck inside redis-py's read never does."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
    if not done:
        task.cancel()
        log.warning("shutdown: %s took over %.0f s; left", what, STOP_WAIT_S)
    elif task.exception() is not None:
        log.warning("shutdown: %s failed: %r", what, task.exception())


async def cancel(tasks: Collection[asyncio.Task], within: float = STOP_WAIT_S) -> set[asyncio.Task]:
    """Cancel ``tasks``, and again at every turn of the event loop while any runs, for at most
    ``within`` seconds; those still running then.

    NOTE: again: Python 3.11's ``asyncio.wait_for`` (redis-py's write of each command under a
    socket_timeout) returns its result rather than raise a cancel that lands as the write ends
    (python/cpython#86296, fixed in 3.12), so a task loses it and runs on. Every turn, not every
    few ms: a repeat on a timer was lost each time (woken by the same select() as the Redis reply,
    the task steps first and starts its next write, and the cancel lands in that window again)."""
    deadline = time.monotonic() + within
    pending = {task for task in tasks if not task.done()}
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        await asyncio.sleep(0)
        pending = {task for task in pending if not task.done()}
    return pending
