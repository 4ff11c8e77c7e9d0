"""``cancel_all``: a task that loses a cancel (as under Python 3.11's ``asyncio.wait_for``) is
cancelled again until it ends; one that never ends is given up after ``within``."""

import asyncio

from producers.cancelling import cancel_all


async def _loses_the_first_cancel(lost: list[int]) -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        lost.append(1)  # the write ended as the cancel came: wait_for returns its result
    await asyncio.Event().wait()  # the next wait, where a repeat lands


async def _ignores_every_cancel(released: asyncio.Event) -> None:
    while not released.is_set():
        try:
            await released.wait()
        except asyncio.CancelledError:
            continue


def test_a_task_that_loses_its_cancel_is_cancelled_again_until_it_ends():
    async def run() -> tuple[set, bool, list[int], set, bool]:
        lost: list[int] = []
        losing = asyncio.create_task(_loses_the_first_cancel(lost))
        released = asyncio.Event()
        stubborn = asyncio.create_task(_ignores_every_cancel(released))
        await asyncio.sleep(0)
        left = await cancel_all([losing], 5)
        given_up = await cancel_all([stubborn], 0.1)
        released.set()
        await stubborn
        return left, losing.cancelled(), lost, given_up, stubborn.done()

    left, cancelled, lost, given_up, ended_later = asyncio.run(run())
    assert left == set() and cancelled and lost == [1]
    assert len(given_up) == 1 and ended_later
