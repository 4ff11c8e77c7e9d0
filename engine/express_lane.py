"""The express lane's part of the step loop (``EngineArgs.express_lane_tokens``, docs/SWAP.md).

While late admission waits for the step in flight, and while a long step is being launched,
arrivals are admitted and a waiting prompt that outranks running work is launched at once,
whole, beside the step on the device (``Scheduler.schedule_express``; the executor's
``express_lane`` stream and graphs). Its first tokens are read back as soon as they are ready:
by the wait, or, for a lane step launched during a long launch, by a later look of the same
launch, which hands them to ``deliver`` (the server's, ``LLMEngine.on_lane_outputs``) at once
instead of after the launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.core.block_manager import BlockManager
from engine.core.scheduler_output import SchedulerOutput
from engine.executor.executor import Executor
from engine.launched import LaunchedStep
from engine.outputs import RequestOutput

# NOTE: how often the wait for the step in flight looks for arrivals and for the lane's first
# tokens: a fifth of a millisecond against steps of 10-30 ms
POLL_S = 0.0002

Execute = Callable[[SchedulerOutput], "LaunchedStep | None"]
Postprocess = Callable[["LaunchedStep | None"], "list[RequestOutput]"]


class ExpressLane:
    """One engine's lane: its step in flight (launched during a step's launch) and its waits."""

    def __init__(self, schedule: Callable[[], "SchedulerOutput | None"], executor: Executor,
                 block_manager: BlockManager, execute: Execute, postprocess: Postprocess) -> None:
        self._schedule = schedule  # the engine's scheduler's ``schedule_express`` (a bench may swap schedulers)
        self.executor, self.block_manager = executor, block_manager
        self._execute, self._postprocess = execute, postprocess  # the engine's own, for a lane step
        self.in_flight: LaunchedStep | None = None  # launched by ``between``, read back by the next wait
        # where ``between`` hands the outputs of a lane step that ended mid-launch (None: the next
        # wait reads it back), and the requests whose first steps it handed over since ``delivered`` was read
        self.deliver: Callable[[list[RequestOutput]], object] | None = None
        self._delivered: tuple[str, ...] = ()

    def beside(self, previous: LaunchedStep, before_schedule: Callable[[], object],
               ) -> tuple[LaunchedStep | None, list[RequestOutput], bool]:
        """Late admission's wait for ``previous``, the step in flight: admit arrivals and run
        the lane beside it, a second lane step behind the first when another prompt may go.
        Returns the (first) lane step (None if none ran), the outputs read back, and whether
        ``previous`` is still in flight (the lane's first tokens were ready before it ended).
        A second lane step is read back with the first when ``previous`` has ended, else kept
        in flight for the next call (``delivered`` names it once read back)."""
        express, self.in_flight = self.in_flight, None
        stacked = None  # a second lane step, launched behind ``express`` on the lane's stream
        while True:
            if express is None:
                before_schedule()
                express = self.launch()
            elif stacked is None:
                # NOTE: a prompt arriving while a lane step runs goes behind it at once, not after
                # its read-back: two arrivals a few ms apart had the second wait for the first's
                # whole lane step, then for a look to launch its own (the mixed bench's p99)
                before_schedule()
                stacked = self.launch()
            if express is not None and express.sample.ready():
                break
            if previous.marker is None or previous.marker.query():
                break
            time.sleep(POLL_S)
        in_flight = previous.marker is not None and not previous.marker.query()
        if not in_flight:
            self.block_manager.settle(previous.epoch)  # NOTE: every step launched so far has ended
        outputs = self._postprocess(express)
        if stacked is not None:
            if in_flight:  # read back by the next wait, or by a look of the next launch
                self.in_flight = stacked
            else:  # NOTE: the step scheduled next must see its first token: read back now
                self._delivered += stacked.first_scheduled
                outputs += self._postprocess(stacked)
        return express, outputs, in_flight

    def between(self, before_schedule: Callable[[], object]) -> None:
        """Called between the pieces of a long step launch: admit arrivals and launch a lane
        step beside the one being launched (read back by the next wait); with ``deliver``, a
        lane step whose first tokens are ready is read back here and its outputs delivered."""
        if self.in_flight is None:
            before_schedule()
            self.in_flight = self.launch()
        elif self.deliver is not None and self.in_flight.sample.ready():
            lane, self.in_flight = self.in_flight, None
            self._delivered += lane.first_scheduled
            self.deliver(self._postprocess(lane))

    def delivered(self) -> tuple[str, ...]:
        """The requests whose lane steps ``between`` delivered since the last call (step observers)."""
        out, self._delivered = self._delivered, ()
        return out

    def finish(self) -> list[RequestOutput]:
        """Read back a lane step still in flight when a call will not wait beside it."""
        lane, self.in_flight = self.in_flight, None
        return self._postprocess(lane)

    def launch(self) -> LaunchedStep | None:
        scheduled = self._schedule()
        if scheduled is None:
            return None
        with self.executor.express_lane():
            return self._execute(scheduled)
