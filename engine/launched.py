"""A step launched on the device and not yet read back (async scheduling keeps one in flight),
and what launching it counts."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Request, Sequence
from engine.runner.prompt_logprobs import PromptLogprobs


@dataclass
class LaunchedStep:
    """A step run on the device whose tokens are not read back yet."""

    scheduled: SchedulerOutput  # what the step ran (the scheduler updates from it once read back)
    sampling: list[Sequence]  # sampled sequences, in the order of the sampler's rows
    sample: Any  # engine.runner.sampler.DeviceSample, or None when nothing was (yet) sampled
    prompt: PromptLogprobs | None = None  # the step's prompt logprobs, when it computed any
    logits: Any = None  # (N, V) on the device: sampling deferred to the next call (constrained rows)
    logit_stats: Any = None  # the deferred logits' ``LogitStats``, when the forward computed them
    first_scheduled: tuple[str, ...] = ()  # requests whose first prompt tokens the step computes
    forward: str | None = None  # how its forward ran (``StepRecord.forward``)
    epoch: int = 0  # the block manager's epoch it was scheduled in (``BlockManager.next_epoch``)
    marker: Any = None  # ``Executor.marker()`` after its launch, when the express lane watches it


def account_step(scheduled: SchedulerOutput, requests: dict[str, Request],
                 scheduled_at: float) -> tuple[list[Sequence], int, tuple[str, ...]]:
    """The sequences a step samples, in row order, the prompt tokens it computes, and the
    requests it first scheduled; stamps each request's first scheduling (``scheduled_at``,
    before the step's launch) and launch (now: the step's kernels are queued on the device, or
    ran on a CPU)."""
    now = time.monotonic()
    sampling, num_prompt, first = [], 0, []
    for item in scheduled.scheduled:
        seq, before = item.seq, item.num_computed_tokens
        if before < seq.num_prompt_tokens:
            num_prompt += min(item.num_new_tokens, seq.num_prompt_tokens - before)
            metrics = requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = scheduled_at
                metrics.first_launched_time = now
                first.append(seq.request_id)
        if item.samples:
            sampling.append(seq)
    return sampling, num_prompt, tuple(dict.fromkeys(first))


def makes_first_tokens(step: LaunchedStep) -> bool:
    """Whether ``step`` samples some sequence's first token after its prompt (a request's TTFT)."""
    return any(item.samples and item.num_computed_tokens < item.seq.num_prompt_tokens
               for item in step.scheduled.scheduled)


def under_launch_lock(method: Callable) -> Callable:
    """Run an engine method holding the engine's ``launch_lock``.

    NOTE: every op a launch makes lets go of the GIL, and a thread of the same process that
    runs Python meanwhile keeps it until the switch interval forces it off (the worker's queue
    reader parsing a backlog of long prompts): each op then waited up to the interval, and the
    steps launched while a worker read its backlog took 4-5x as long. Such a thread takes the
    lock around its work, so a schedule or a launch waits at most for one piece of that work,
    once, and the thread for the launch.
    """

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.launch_lock:
            return method(self, *args, **kwargs)

    return locked
