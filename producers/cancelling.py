"""Cancelling asyncio tasks that may lose a cancel.

Python 3.11's ``asyncio.wait_for``, which redis-py's asyncio client puts around the write of
each command (under a socket_timeout), returns its result rather than raise a cancel that lands
as the write ends (python/cpython#86296, fixed in 3.12): the task loses the cancel and runs on.
Its reads are under ``asyncio.timeout``, which loses none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection

RECANCEL_S = 0.02  # between two cancels of a task that still runs


async def cancel_all(tasks: Collection[asyncio.Task], within: float) -> set[asyncio.Task]:
    """Cancel ``tasks``, and again every ``RECANCEL_S`` while any runs, for at most ``within``
    seconds; those still running then.

    NOTE: a repeat can be lost as the first was (a task of back-to-back commands, woken by the
    same select() as a Redis reply, steps into its next write), so a loop that must end also
    looks for its stop at each pass (the batch feeder's, the stream reader's); a repeat ends it
    sooner wherever it lands in a wait (a read, a sleep). Not at every turn of the event loop:
    that kept a core busy until the tasks ended, ``within`` for one that never does."""
    deadline = time.monotonic() + within
    pending = {task for task in tasks if not task.done()}
    while pending and (left := deadline - time.monotonic()) > 0:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
    return pending
