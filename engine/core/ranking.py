"""Who outranks whom inside the scheduler: order, victims of rank preemption, aging.

Plain Python over sequences. Under ``scheduling_policy="priority"`` a sequence's rank is its
``priority`` (higher first; the worker folds the job's queue into it, ``worker/ranks.py``),
then arrival; under ``"fcfs"`` arrival alone and nobody outranks anybody.

- Order: running sequences by rank; the ones that wait for a seat (waiting and swapped) by
  rank, a swapped sequence before a waiting one of the same rank, and *aged* ones before all
  others.
- Rank preemption: a waiting or swapped sequence that does not fit takes the seats and
  blocks of running ones of strictly lower rank, lowest rank first, then latest arrival,
  when their blocks suffice (nobody is preempted in vain).
- Budget: in the step that seats a sequence, the work of running sequences it outranks
  waits a step -- prefill chunks always, decodes unless they waited the step before -- and,
  when it held such work back, no waiting or swapped sequence it outranks is seated either:
  that step is as short as its own prefill; decodes of its own rank wait too if only that
  lets its whole prompt fit (``Scheduler._peer_decodes``).
- No thrash: a sequence that gets a seat after it lost one (swapped back in, or readmitted
  to recompute), or once aged, is not preempted for rank for ``min_resident_steps``
  scheduler steps.
- No starvation: a sequence waits ``passed_over`` steps in which higher-rank work got a seat
  ahead of it; after ``aging_steps`` of them it is aged: it goes before every sequence that
  is not, whatever their rank, so the next seat and blocks that free up are its. One that
  cannot run does not stop the round for work that outranks it (``Scheduler._seat_waiting``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from heapq import merge
from itertools import chain

from engine.config import SchedulerConfig
from engine.core.sequence import Sequence, SequenceStatus


class Ranking:
    """The scheduling policy's order and preemption rules for one scheduler."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.by_priority = config.scheduling_policy == "priority"
        self.aging_steps = config.aging_steps
        self.min_resident_steps = config.min_resident_steps
        self._maybe_aged = False  # some sequence may be aged: only then is every waiting one looked at

    def key(self, seq: Sequence) -> tuple[int, int, int]:
        """Run order: rank, then first come first served."""
        return seq.sort_key if self.by_priority else (0, seq.arrival_order, seq.index)

    def seat_key(self, seq: Sequence) -> tuple[int, int, int, int]:
        """Order of sequences waiting for a seat: rank, swapped before waiting, then arrival."""
        rank, arrival, index = self.key(seq)
        return rank, 0 if seq.status is SequenceStatus.SWAPPED else 1, arrival, index

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        return self.by_priority and seq.priority > other.priority

    def is_aged(self, seq: Sequence) -> bool:
        return seq.passed_over >= self.aging_steps

    def candidates(self, swapped: list[Sequence], waiting: list[Sequence]) -> Iterator[Sequence]:
        """Everything waiting for a seat now, in the order seats go (both lists sorted by
        ``key``); taken at the call, so sequences preempted while it is read are not in it."""
        rest = merge(list(swapped), list(waiting), key=self.seat_key)
        if not self._maybe_aged:
            return rest
        aged = sorted((s for s in (*swapped, *waiting) if self.is_aged(s)), key=self.seat_key)
        self._maybe_aged = bool(aged)
        return chain(aged, (seq for seq in rest if not self.is_aged(seq)))

    def has_aged(self, swapped: list[Sequence], waiting: list[Sequence]) -> bool:
        """Whether some sequence waiting for a seat is aged (it goes before everything else)."""
        return self._maybe_aged and any(self.is_aged(s) for s in (*swapped, *waiting))

    def victims(self, seq: Sequence, running: Iterable[Sequence], step: int) -> list[Sequence]:
        """Running sequences ``seq`` may preempt, in the order it takes them."""
        eligible = [v for v in running if step >= v.safe_until_step and self.outranks(seq, v)]
        return sorted(eligible, key=lambda v: (v.priority, -v.arrival_order, -v.index))

    def seated(self, seq: Sequence, step: int) -> None:
        """``seq`` got a seat at ``step``: its wait is over; if it had lost a seat before or
        was aged, it is safe from rank preemption for a while.

        NOTE: not a sequence merely passed over a few times: nearly every bulk sequence is,
        under steady interactive traffic, and protecting them all would leave an arriving
        interactive job no victim."""
        if seq.num_preemptions or self.is_aged(seq):
            seq.safe_until_step = step + self.min_resident_steps
        seq.passed_over = 0

    def age(self, seated: list[Sequence], still_waiting: Iterable[Sequence]) -> None:
        """Count a step passed over for every waiting sequence outranked by one seated this step."""
        if not self.by_priority or not seated:
            return
        top = max(s.priority for s in seated)
        for seq in still_waiting:
            if seq.priority < top:
                seq.passed_over += 1
                self._maybe_aged |= seq.passed_over >= self.aging_steps
