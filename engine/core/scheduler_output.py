"""What the scheduler hands out each step (``SchedulerOutput`` of ``ScheduledSeq``) and the
counts it keeps (``SchedulerStats``); ``engine/core/scheduler.py`` makes them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at num_computed_tokens
    num_computed_tokens: int  # the sequence's computed tokens before this step
    samples: bool  # the step reaches the sequence's last token, so a new one is sampled

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> "ScheduledSeq":
        """``num_new_tokens`` more of ``seq``, from where its computation stands now."""
        start = seq.num_computed_tokens
        return cls(seq, num_new_tokens, start, start + num_new_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    """What runs this step and which blocks move first; consumed by the model runner."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # batch order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu), before the forward
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu), before the forward
    preempted: list[Sequence] = field(default_factory=list)
    filled: list[Sequence] = field(default_factory=list)  # whose step completes a block (update_from_output)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and no block to move."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swap_outs: int = 0  # sequences swapped out
    num_swap_ins: int = 0  # sequences swapped back in
    num_recomputes: int = 0  # sequences preempted by dropping their blocks
    num_rank_preemptions: int = 0  # preemptions that gave a seat to a higher-rank sequence (of num_preemptions)
    num_swapped_out_blocks: int = 0  # blocks copied to the CPU pool (shared blocks count once)
    num_swapped_in_blocks: int = 0  # blocks copied back to the GPU
    num_express: int = 0  # prompts run in the express lane, beside the step in flight
