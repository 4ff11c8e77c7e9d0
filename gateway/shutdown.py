"""A gateway's shutdown, bounded: nothing it waits on keeps the process from exiting."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection
from typing import Any

from producers.cancelling import cancel_all

log = logging.getLogger("sluiceway.gateway")

STOP_WAIT_S = 5.0  # for each part of the shutdown: tasks to end after their cancel, a lease release, a close


async def bounded(work: Awaitable[Any], what: str) -> None:
    """Await ``work`` for at most ``STOP_WAIT_S`` at shutdown, then leave it (logged), failed or not.

    NOTE: not ``wait_for``: on its timeout that waits for the cancelled work to end, which work
    that loses the cancel (in a redis-py write: ``producers.cancelling``) does only when it is done."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
    if not done:
        task.cancel()
        log.warning("shutdown: %s took over %.0f s; left", what, STOP_WAIT_S)
    elif task.exception() is not None:
        log.warning("shutdown: %s failed: %r", what, task.exception())


async def cancel(tasks: Collection[asyncio.Task], within: float = STOP_WAIT_S) -> set[asyncio.Task]:
    """Cancel ``tasks`` until they end, for at most ``within`` seconds (a task may lose a cancel:
    ``producers.cancelling``); those still running then."""
    return await cancel_all(tasks, within)
