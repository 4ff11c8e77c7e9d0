"""The express lane's rules in the scheduler (docs/SWAP.md, ``EngineArgs.express_lane_tokens``).

Plain Python over sequences. While a step runs on the device, a waiting prompt that outranks
running work may run beside it, whole, in a step of its own (the engine launches it on a
high-priority stream). This module says which prompt may (``ExpressLane.candidate``) and how
many GPU blocks lower-ranked admissions leave free for it (``reserve``): the lane cannot
preempt anyone, since the step in flight still uses their blocks.
"""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.ranking import Ranking
from engine.core.sequence import Sequence, SequenceStatus


class ExpressLane:
    """The lane's candidate and reserve for one scheduler's queues."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, ranking: Ranking) -> None:
        self.tokens = config.express_lane_tokens if ranking.by_priority else 0
        self.max_num_seqs = config.max_num_seqs
        self.bm = block_manager
        self.ranking = ranking

    @property
    def reserve(self) -> int:
        """GPU blocks that seating work of no higher rank than all running work leaves free:
        two lane prompts' (0 when the lane is off).

        NOTE: counted against whole prompts (``need``), not the chunk a step seats: a bulk
        prompt admitted chunk by chunk would otherwise grow into the reserve a step later."""
        return 2 * -(-self.tokens // self.bm.block_size) if self.tokens else 0

    def need(self, seq: Sequence) -> int:
        """GPU blocks ``seq`` still lacks for every token it has (its whole prompt, not this
        step's chunk; a swapped sequence's blocks are in the CPU pool)."""
        held = 0 if seq.status is SequenceStatus.SWAPPED else len(seq.block_table)
        return max(0, -(-seq.num_tokens // self.bm.block_size) - held)

    def promised(self, running: list[Sequence]) -> int:
        """Blocks running sequences still lack for the tokens they have (prompts seated chunk by chunk)."""
        return sum(self.need(seq) for seq in running)

    def candidate(self, waiting: list[Sequence], running: list[Sequence],
                  swapped: list[Sequence]) -> tuple[Sequence, int, list[int]] | None:
        """The waiting sequence to run in the lane now, its tokens and its cached prefix blocks; or None.

        The first waiting sequence in seat order goes if it outranks some running sequence and
        nothing goes before it (no swapped sequence of its rank or higher, no aged one), its
        prompt past any cached prefix is at most ``tokens``, a seat is free and so are its
        blocks outside the quarantine (``BlockManager.track_frees``). Not for constrained
        sequences (their bitmask follows the tokens of the step in flight), prompt logprobs or
        scoring gates (index -1).
        """
        if not self.tokens or not waiting or not running or len(running) >= self.max_num_seqs:
            return None
        seq = waiting[0]
        if seq.priority <= min(s.priority for s in running) or any(s.priority >= seq.priority for s in swapped):
            return None
        if self.ranking.has_aged(swapped, waiting):
            return None
        if seq.grammar is not None or seq.prompt_logprobs_from is not None or seq.index < 0:
            return None
        cached = self.bm.find_cached_prefix(seq)
        if cached and self.bm.prefix_in_flight(seq, cached):
            return None
        num_new = seq.num_tokens - len(cached) * self.bm.block_size
        if num_new > self.tokens:
            return None
        if self.bm.blocks_needed(seq, num_new, cached) > self.bm.gpu.num_free_outside(self.bm.quarantined):
            return None
        return seq, num_new, cached
