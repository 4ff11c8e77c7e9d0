"""Step observers: what each ``LLMEngine.step()`` call did, for whoever wants to watch.

``LLMEngine.add_step_observer(callback)`` makes the engine call ``callback(record)`` with a
``StepRecord`` at the end of every ``step()``, after the step's outputs are made;
``remove_step_observer(callback)`` stops it. A benchmark's per-step statistics, a metrics
exporter or a test read the engine this way instead of reaching into its internals. Plain
Python, no torch; observers run in the engine's thread, so they should be quick.

Steps are numbered by ``step()`` call, from 0 for an engine's first call. A call *launches*
the step it schedules (the model runs and tokens are chosen on the device) and *resolves*
a launched step (its tokens are read back and appended). Synchronously a call resolves the
step it launched; with async scheduling it resolves the step the call before launched,
while its own runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class StepRecord:
    """One ``LLMEngine.step()`` call."""

    step: int  # this call's number: 0 for the engine's first step() call
    num_seqs: int  # sequences this call scheduled (and launched)
    # their tokens: prompt tokens (chunks, and the lone last token of a prompt whose prefix was
    # cached) and the tokens of sequences computing several at once (recompute)
    num_prefill_tokens: int
    num_decode_tokens: int  # one per sequence computing one token past its prompt (a decode)
    resolved: tuple[int, ...]  # the steps whose tokens this call read back, oldest first; () when none
    num_generated_tokens: int  # tokens this call appended to sequences (those of the resolved steps)
    # The step whose model run this call's time went to: on a GPU the launch returns at once
    # and the call waits when it reads tokens back, so the latest resolved step (None when it
    # resolved none); where the forward runs inside the launch (the CPU), this call's own step.
    waited_for: int | None
    duration_s: float  # wall time of the step() call
    # requests whose first prompt tokens this call scheduled (their TTFT's step begins here)
    first_scheduled: tuple[str, ...] = ()
    # how the launched step's forward ran: "decode_graph", "whole_graph" (a prompt step in one
    # replay), "piece_graphs" (replays between eager attentions), "eager"; None: nothing launched
    forward: str | None = None
    # requests whose prompts ran in the express lane during this call, beside the step in flight
    # (docs/SWAP.md); when the call returned their first tokens before that step ended, they are
    # its only work (``first_scheduled`` too, ``forward`` theirs: "express_graph" or "eager")
    express: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        """Tokens this call scheduled: prefill and decode together."""
        return self.num_prefill_tokens + self.num_decode_tokens


StepObserver = Callable[[StepRecord], object]

logger = logging.getLogger(__name__)


class StepObservers:
    """An engine's step observers and the count of its ``step()`` calls.

    ``launch_runs_forward``: the model runs inside the launch (the CPU) rather than queued
    on a device that the host later waits for (CUDA); it decides ``StepRecord.waited_for``.
    """

    def __init__(self, launch_runs_forward: bool) -> None:
        self.launch_runs_forward = launch_runs_forward
        self.num_steps = 0  # step() calls so far: the number of the next record
        self._observers: list[StepObserver] = []

    def add(self, observer: StepObserver) -> None:
        if not callable(observer):
            raise ValueError(f"a step observer must be callable, got {observer!r}")
        self._observers.append(observer)

    def remove(self, observer: StepObserver) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def step_done(self, started: float, scheduled: SchedulerOutput, num_generated_tokens: int,
                  resolved_previous: bool, resolved_launched: bool, first_scheduled: tuple[str, ...] = (),
                  forward: str | None = None, express: tuple[str, ...] = ()) -> None:
        """A ``step()`` call has ended: it began at ``started`` (``time.perf_counter()``),
        scheduled ``scheduled``, appended ``num_generated_tokens`` tokens and read back the
        step the call before launched (``resolved_previous``) and/or its own
        (``resolved_launched``). Numbers the call and hands its record to every observer."""
        step = self.num_steps
        self.num_steps += 1
        if not self._observers:
            return
        duration_s = time.perf_counter() - started
        resolved = ((step - 1,) if resolved_previous else ()) + ((step,) if resolved_launched else ())
        if self.launch_runs_forward:
            waited_for: int | None = step
        else:
            waited_for = resolved[-1] if resolved else None
        tokens = decode = 0
        for item in scheduled.scheduled:  # one pass: at 512 sequences this is most of the record's cost
            tokens += item.num_new_tokens
            decode += item.num_new_tokens == 1 and item.num_computed_tokens >= item.seq.num_prompt_tokens
        record = StepRecord(step=step, num_seqs=len(scheduled.scheduled),
                            num_prefill_tokens=tokens - decode, num_decode_tokens=decode,
                            resolved=resolved, num_generated_tokens=num_generated_tokens, waited_for=waited_for,
                            duration_s=duration_s, first_scheduled=first_scheduled, forward=forward,
                            express=express)
        for observer in list(self._observers):
            try:
                observer(record)
            except Exception:
                # NOTE: the step is done and its outputs must reach the caller; an observer that
                # raises is logged and dropped, so it fails once rather than on every step.
                logger.exception("step observer %r raised; it is removed", observer)
                self.remove(observer)
