"""The batch feeder's stop: a task that loses its cancel (Python 3.11's ``asyncio.wait_for``, under
each redis-py write, loses one that lands as the write ends) ends all the same, and one that
ignores every cancel cannot keep a gateway from exiting."""

import asyncio
import time

from gateway import batch_feeder
from gateway.batch_service import BatchService
from gateway.batch_settings import BatchSettings
from gateway.models import ModelDirectory
from producers.connection import connect_async
from producers.protocol import Keys


async def _stubborn(released: asyncio.Event) -> None:
    """Ignores every cancel until ``released``, as a read stuck inside redis-py did."""
    while not released.is_set():
        try:
            await released.wait()
        except asyncio.CancelledError:
            continue


def test_a_task_that_ignores_its_cancel_does_not_hang_the_shutdown(redis_server, monkeypatch):
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 0.3, raising=False)

    async def run() -> tuple[float | None, bool]:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), Keys(), 1.0)
        service = BatchService(redis_server, Keys().prefix, models, BatchSettings(poll_seconds=0.05))
        await service.start()
        released = asyncio.Event()
        stuck = asyncio.create_task(_stubborn(released))
        service.feeder._tasks["batch_stuck"] = stuck
        await asyncio.sleep(0.1)  # the scanner has run a pass or two
        started = time.monotonic()
        closing = asyncio.create_task(service.close())
        try:
            done, _ = await asyncio.wait({closing}, timeout=5)  # NOTE: not wait_for, which would wait on the cancel
            return (time.monotonic() - started if done else None), not stuck.done()
        finally:
            released.set()
            await stuck
            await closing
            await models.redis.aclose()

    took, still_running = asyncio.run(run())
    assert took is not None and took < 2 and still_running  # it gave up on the task after STOP_WAIT_S


def test_a_scan_that_loses_the_stops_cancel_ends_all_the_same(redis_server, monkeypatch):
    """The scanner's pass returns where the cancel landed, as 3.11's ``wait_for`` does when the
    write it waits on has just ended: the scan loop ran on, the stop gave up on it after
    ``STOP_WAIT_S``, and ``asyncio.run`` waited on it at exit (CI: past 45 s, its last cancel lost too)."""
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 3)

    async def run() -> tuple[float, bool]:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), Keys(), 1.0)
        service = BatchService(redis_server, Keys().prefix, models, BatchSettings(poll_seconds=0.05))
        inside, sweep = asyncio.Event(), service.removal.sweep_expired

        async def loses_a_cancel() -> int:
            if inside.is_set():
                return await sweep()
            inside.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                pass  # the write ended as the cancel came: wait_for returns its result
            return 0

        service.removal.sweep_expired = loses_a_cancel
        await service.start()
        await inside.wait()
        started = time.monotonic()
        await service.close()
        try:
            return time.monotonic() - started, service.feeder._scanner.done()
        finally:
            await models.redis.aclose()

    took, ended = asyncio.run(run())
    assert ended and took < 1
