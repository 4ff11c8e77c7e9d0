"""A gateway's shutdown, bounded: nothing it waits on keeps the process from exiting."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
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
