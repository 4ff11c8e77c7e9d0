"""Helpers of the rank-preemption and express-lane scheduler tests: a ranked sequence, and one
step's bookkeeping as the engine does it around ``Scheduler.schedule``."""

from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams


def seq(name, length, priority=0, arrival=0):
    tokens = [1000 + 31 * arrival + j for j in range(length)]
    return Sequence(name, 0, tokens, length, SamplingParams(max_tokens=64), priority=priority, arrival_order=arrival)


def step(sched):
    sched.bm.next_epoch()
    out = sched.schedule()
    sched.update_from_output(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.token_ids.append(7)
    sched.commit_filled_blocks(out)
    return out
