"""The scheduler: which sequences compute how many tokens this step.

Plain Python, no torch. There is no prefill or decode phase: each running sequence asks
for ``num_tokens - num_computed_tokens`` more tokens (a whole prompt, a chunk of it, or one
decode token) and the step's token budget and sequence budget decide how much it gets.
Order: running sequences first, then the swapped and waiting ones in the order of
``engine/core/ranking.py`` (rank, swapped before waiting of the same rank), the first that
cannot run stopping the round; one that outranks running sequences takes their seats and
blocks (rank preemption, docs/SWAP.md).

The scheduler keeps its own books: ``update_from_output`` counts a step's tokens as computed
once the step has run (so a step in flight is never scheduled again), and
``commit_filled_blocks`` publishes the blocks it filled once its sampled tokens are read back.
"""

from __future__ import annotations

import bisect
from collections import deque

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.express import ExpressLane
from engine.core.ranking import Ranking
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput, SchedulerStats
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.stopping import at_length_limit
from engine.core.swap import PreemptionCostModel


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        cost_model: PreemptionCostModel | None = None,
    ) -> None:
        self.config = config
        self.bm = block_manager
        # NOTE: without a cost model ``auto`` swaps whenever the pool has room: on a GPU,
        # recomputing a sequence costs several times more than copying its blocks.
        self.cost_model = cost_model
        self.ranking = Ranking(config)
        self.express = ExpressLane(config, block_manager, self.ranking)
        self.waiting: list[Sequence] = []  # sorted by ranking.key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # sorted by ranking.key
        self.stats = SchedulerStats()
        self.num_steps = 0  # schedule() calls: the clock of the no-thrash bound
        self._decodes_held_at = -1  # the last step whose outranked decodes waited for a seating (``_outranked_work``)

    # ----- queue management ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.ranking.key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (done or aborted) and free its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def finish_stopped(self, seq: Sequence) -> None:
        """Retire a sequence that its token just read back ended, publishing first the blocks
        its last step filled (``commit_filled_blocks`` skips a finished sequence): a request
        that ends at its first token still leaves its prompt in the prefix cache."""
        if seq.status is SequenceStatus.RUNNING:
            self.bm.commit(seq)
        self.finish(seq)

    # ----- the step ------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step ran (its tokens may still be on the device): they count as computed.

        NOTE: not in ``schedule()``: a step whose execution raises leaves every sequence where
        it was, so the step can be run again.
        """
        bs = self.bm.block_size
        for item in out.scheduled:
            seq, before = item.seq, item.num_computed_tokens
            seq.num_computed_tokens = before + item.num_new_tokens
            if seq.num_computed_tokens // bs != before // bs:
                out.filled.append(seq)

    def commit_filled_blocks(self, out: SchedulerOutput) -> None:
        """The step's sampled tokens were read back: publish the hashes of the blocks it filled.

        Called after the step's finished sequences were retired: a sequence preempted or
        finished since the step ran publishes nothing.
        """
        for seq in out.filled:
            if seq.status is SequenceStatus.RUNNING:
                self.bm.commit(seq)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._seat_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give running sequences their tokens, preempting the lowest-ranked ones when blocks run out."""
        queue = deque(sorted(self.running, key=self.ranking.key))
        self.running = []
        block_size = self.bm.block_size
        while queue:
            seq = queue.popleft()
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.num_pending and at_length_limit(seq, seq.num_tokens, self.config.max_model_len):
                num_new = 0  # its pending token is its last: it finishes when that is read back
            if num_new <= 0:
                self.running.append(seq)  # out of budget: keeps its blocks, waits a step
                continue
            if seq.num_computed_tokens + num_new <= len(seq.block_table) * block_size:
                # NOTE: fits in the blocks it holds (most decode steps): nothing to allocate
                out.scheduled.append(ScheduledSeq.of(seq, num_new))
                self.running.append(seq)
                budget -= num_new
                continue
            while not self.bm.can_allocate(seq, num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.bm.allocate(seq, num_new)
                out.scheduled.append(ScheduledSeq.of(seq, num_new))
                self.running.append(seq)
                budget -= num_new
        return budget

    def _seat_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Seat swapped and waiting sequences in rank order while they fit, preempting lower ranks.

        NOTE: the first one that cannot run stops the round (head of line), so no sequence
        ever overtakes one that goes before it; one preempted this step (it lacked room to
        grow) cannot run, so it stops the round too. The one exception: behind an aged
        sequence that cannot run, work that outranks it still goes on, without the free blocks
        the aged one would take (``_held_for``).
        """
        preempted = set(map(id, out.preempted))
        reserve = self.express.reserve
        lowest = min((s.priority for s in self.running), default=None) if reserve else None
        promised = self.express.promised(self.running) if reserve else 0
        seated: list[Sequence] = []
        displacing: list[Sequence] = []  # seated this step, holding outranked running work back
        blocked: Sequence | None = None  # an aged sequence that found no room this step
        held = 0  # GPU blocks free now that stay free for it
        for seq in self.ranking.candidates(self.swapped, self.waiting):
            if blocked is not None and not self.ranking.outranks(seq, blocked):
                continue
            if id(seq) in preempted or any(self.ranking.outranks(top, seq) for top in displacing):
                # NOTE: work outranked by one that held running work back this step waits a step
                # too: a new bulk prompt seated beside an interactive one would double the step
                # the interactive job waits on for its first token
                break
            prefix = self.bm.find_cached_prefix(seq) if seq.status is SequenceStatus.WAITING else None
            if prefix is not None and self.bm.prefix_in_flight(seq, prefix):
                continue  # NOTE: its next prefix block is being computed: passed over until published
            chunks = self._outranked_work(seq, out)
            usable = budget + sum(item.num_new_tokens for item in chunks)
            if chunks:
                peers = self._peer_decodes(seq, out, chunks, usable, prefix)
                chunks += peers
                usable += len(peers)
            victims: list[Sequence] | None = []
            keeps_reserve = reserve and not (lowest is not None and seq.priority > lowest)
            if keeps_reserve and self.express.need(seq) > self.bm.gpu.num_free - held - promised - reserve:
                victims = None  # NOTE: it would take what the express lane keeps free (it outranks no running work)
            elif usable > 0:
                num_new, cached, short = self._demand(seq, usable, held, prefix)
                if short > 0 or len(self.running) >= self.config.max_num_seqs:
                    victims = self._victims(seq, short)
                if victims is None and held:
                    # NOTE: no running work it may preempt (all of it safe, or too little): it
                    # takes the blocks kept for the aged sequence rather than wait out the
                    # no-thrash bound behind it; the aged one still goes first at every step.
                    num_new, cached, short = self._demand(seq, usable, prefix=prefix)
                    victims = self._victims(seq, short)
                    held = 0 if victims is not None else held
            if usable <= 0 or victims is None:
                if blocked is None and self.ranking.by_priority and self.ranking.is_aged(seq):
                    # NOTE: an aged sequence waits for the budget, seats and blocks that free up
                    # (it preempts no one); it must not also hold back work that outranks it and
                    # could take its way in: the round would stop behind it until running work
                    # finished, and aging makes every long-waiting bulk sequence go first at
                    # once. The blocks free now stay free for it: what goes on takes the budget
                    # of outranked prefills and the seats and blocks of running work it outranks.
                    blocked, held = seq, self._held_for(seq)
                    continue
                break
            # NOTE: it runs this step: the work it outranks waits a step (``_outranked_work``),
            # so this step is as short as its own prefill, not one carrying a bulk prompt or
            # the bulk decodes' long contexts; and it takes the seats and blocks it lacks.
            for item in chunks:
                out.scheduled.remove(item)
                budget += item.num_new_tokens
                if item.num_new_tokens == 1:
                    self._decodes_held_at = self.num_steps
            for victim in victims:
                budget += self._unschedule(victim, out)
                self._preempt(victim, out)
                preempted.add(id(victim))
                self.stats.num_rank_preemptions += 1
            # NOTE: preempting frees blocks, which may change what of the prefix is cached
            num_new, cached, short = self._demand(seq, budget, held, None if victims else prefix)
            if short > 0 or num_new <= 0:
                break
            budget -= self._seat(seq, num_new, cached, out)
            if reserve:
                promised += self.express.need(seq)
            seated.append(seq)
            if chunks or victims:
                displacing.append(seq)
        self.ranking.age(seated, (*self.swapped, *self.waiting))

    def schedule_express(self) -> SchedulerOutput | None:
        """A step of one waiting prompt, whole, to run beside the step in flight (the express
        lane, ``engine/core/express.py``), or None when none may."""
        found = self.express.candidate(self.waiting, self.running, self.swapped)
        if found is None:
            return None
        seq, num_new, cached = found
        self.waiting.remove(seq)
        self.bm.allocate(seq, num_new, cached, avoid=self.bm.quarantined)
        seq.status = SequenceStatus.RUNNING
        self.ranking.seated(seq, self.num_steps)
        self.running.append(seq)
        self.stats.num_express += 1
        return SchedulerOutput([ScheduledSeq.of(seq, num_new)])

    def _held_for(self, seq: Sequence) -> int:
        """The free GPU blocks an aged ``seq`` would take in a step of its own (kept for it)."""
        free = self.bm.gpu.num_free
        _, _, short = self._demand(seq, self.config.max_num_batched_tokens)
        return max(0, min(free, short + free))

    def _outranked_work(self, seq: Sequence, out: SchedulerOutput) -> list[ScheduledSeq]:
        """This step's items of running sequences ``seq`` outranks: they wait a step if it is seated.

        Prefill chunks always; decodes too unless they waited in the step before.

        NOTE: a decode beside a prompt costs little compute but its whole context's K/V: on an
        H200, 46 bulk decodes of 4,200 tokens read 24.7 GB, ~6 ms, about as long as a 256-token
        interactive prefill alone. Held back for one step they cost bulk that step's decodes
        (twice a second under the mixed bench's arrivals); never two steps running, so
        interactive arrivals one after another cannot stall bulk decodes.
        """
        if not self.ranking.by_priority:
            return []
        hold_decodes = self._decodes_held_at < self.num_steps - 1
        return [item for item in out.scheduled
                if (item.num_new_tokens > 1 or hold_decodes) and self.ranking.outranks(seq, item.seq)]

    def _peer_decodes(self, seq: Sequence, out: SchedulerOutput, chunks: list[ScheduledSeq], usable: int,
                      prefix: list[int] | None) -> list[ScheduledSeq]:
        """Decodes of ``seq``'s own rank or lower that wait a step too, when ``seq`` holds
        outranked work back and only that lets the rest of its prompt fit this step.

        NOTE: otherwise its last prompt tokens, and so its first token, would wait for the next
        step, a bulk one (a 256-token prompt beside three interactive decodes at a budget of
        256); the decodes that wait are bound by the same never-two-steps-running rule."""
        if self._decodes_held_at >= self.num_steps - 1:
            return []
        short = self._demand(seq, self.config.max_num_batched_tokens, prefix=prefix)[0] - usable
        if short <= 0:
            return []
        taken = set(map(id, chunks))
        peers = [item for item in out.scheduled if id(item) not in taken and item.num_new_tokens == 1
                 and not self.ranking.outranks(item.seq, seq)]
        return peers[-short:] if len(peers) >= short else []

    def _demand(self, seq: Sequence, budget: int, held: int = 0,
                prefix: list[int] | None = None) -> tuple[int, list[int], int]:
        """Tokens ``seq`` would compute this step, its cached prefix blocks, and how many
        GPU blocks it lacks for them (``held`` of the free ones are not its to take;
        ``prefix``: its cached prefix when the caller already looked it up)."""
        free = self.bm.gpu.num_free - held
        if seq.status is SequenceStatus.SWAPPED:
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            total = -(-(seq.num_computed_tokens + num_new) // self.bm.block_size)
            return num_new, [], max(total, len(seq.block_table)) - free
        cached = self.bm.find_cached_prefix(seq) if prefix is None else prefix
        remaining = seq.num_tokens - seq.num_computed_tokens - len(cached) * self.bm.block_size
        num_new = min(remaining, budget)
        return num_new, cached, self.bm.blocks_needed(seq, num_new, cached) - free

    def _victims(self, seq: Sequence, short: int) -> list[Sequence] | None:
        """The running sequences whose seats and blocks ``seq`` takes, or None when even all it
        may take would not make room."""
        need_seat = len(self.running) >= self.config.max_num_seqs
        taken: list[Sequence] = []
        for victim in self.ranking.victims(seq, self.running, self.num_steps):
            if short <= 0 and not need_seat:
                break
            taken.append(victim)
            short -= sum(1 for b in victim.block_table if self.bm.gpu.ref_counts[b] == 1)
            need_seat = False
        return taken if short <= 0 and not need_seat else None

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Take ``seq`` out of the running set and this step's batch; return the tokens it had."""
        self.running.remove(seq)
        for i, item in enumerate(out.scheduled):
            if item.seq is seq:
                del out.scheduled[i]
                return item.num_new_tokens
        return 0

    def _seat(self, seq: Sequence, num_new: int, cached: list[int], out: SchedulerOutput) -> int:
        """Bring a swapped sequence back or admit a waiting one, for ``num_new`` tokens."""
        if seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            copies = self.bm.swap_in(seq)
            out.blocks_to_swap_in.extend(copies)
            self.stats.num_swap_ins += 1
            self.stats.num_swapped_in_blocks += len(copies)
            self.bm.allocate(seq, num_new)
        else:
            self.waiting.remove(seq)
            self.bm.allocate(seq, num_new, cached)
        seq.status = SequenceStatus.RUNNING
        self.ranking.seated(seq, self.num_steps)
        out.scheduled.append(ScheduledSeq.of(seq, num_new))
        self.running.append(seq)
        return num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Make room: swap the sequence's blocks out, or drop them to recompute later.

        A swap that does not fit in the CPU pool's free blocks falls back to recompute.
        """
        out.preempted.append(seq)
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        mode = self.config.preemption_mode
        swap = mode == "swap" or (mode == "auto" and self._prefer_swap(seq))
        if swap and self.bm.cpu.num_blocks and self.bm.can_swap_out(seq):
            copies = self.bm.swap_out(seq)
            out.blocks_to_swap_out.extend(copies)
            self.stats.num_swap_outs += 1
            self.stats.num_swapped_out_blocks += len(copies)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=self.ranking.key)
        else:
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            self.stats.num_recomputes += 1
            self.add(seq)

    def _prefer_swap(self, seq: Sequence) -> bool:
        return self.cost_model is None or self.cost_model.prefer_swap(seq, self.bm)
