"""The one admission path: ingress sources hand ``Work`` in, the step loop takes it out.

A source (the Redis queue reader, ``worker/intake.py``; the Celery ingress,
``worker/celery_ingress.py``) waits for ``room()``, offers ``Work`` whose ``sink`` knows how
to publish that job's deltas and store its end. The step loop sets the capacity the engine
has, takes work, and hands results to ``work.sink`` -- it never knows which source a job
came from.

Admission is also the one place a cancel waits until the step loop applies it (asked by the
cancel watcher for a client's cancel key, or by the Celery ingress for a revoke): the step
loop aborts the job if it is in the engine, and otherwise ends it when it takes it out of
here (``cancel_reason``); a cancel is forgotten once its job is no longer held.

With ``prepare=True`` a job given as text or chat messages first goes to the preparer's
thread (``worker/prepare.py``), which tokenizes it and puts it in the ready queue (or fails
it): the step loop only ever adds token ids. Jobs being prepared count against ``room()``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from producers.protocol import ErrorCode, Job, JobResult, Status, TokenDelta


class Sink(Protocol):
    """Where a source wants a job's output to go. Every method must return at once."""

    def publish(self, work: "Work", deltas: list[TokenDelta]) -> None: ...

    def publish_step(self, items: list[tuple["Work", list[TokenDelta]]]) -> None:
        """``publish`` for each ``(work, deltas)`` of one engine step, handed over at once."""

    def finish(self, work: "Work", status: Status, result: JobResult | None = None, error: str | None = None,
               code: ErrorCode | None = None) -> None:
        """Store the job's end; ``code`` is its ``ErrorCode`` (every end but ``done`` has one)."""

    def release(self, work: "Work") -> None: ...

    def checkpoint(self, work: "Work", token_ids: list[int]) -> None:
        """Keep ``token_ids``, the output generated so far, where a later run can resume from."""


@dataclass(eq=False)
class Work:
    """One job taken by this worker, from the moment a source reads it until it ends."""

    job: Job
    sink: Sink
    queue: str | None = None  # the source's queue name
    entry_id: str | None = None  # the source's handle on the delivery (a stream entry id)
    enqueued_at: float | None = None  # unix seconds
    started_at: float = 0.0  # unix seconds: taken by this worker
    attempt: int = 1
    prompt_token_ids: list[int] | None = None  # the prompt tokenized off the step loop (worker/prepare.py)
    resume_token_ids: list[int] | None = None  # output an earlier run of the job produced: this run continues it
    ready_at: float | None = None  # unix seconds: its prompt ready as token ids, waiting for the step loop
    # Filled in by the step loop.
    admitted_at: float | None = None
    first_token_at: float | None = None
    streamed_to_end: set[int] = field(default_factory=set)  # completions whose last delta went out
    checkpointed: int = 0  # output tokens in the last progress checkpoint queued for this run
    stream_entries: int = 0  # entries its tokens stream held when this run started (an earlier run's)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def needs_tokens(self) -> bool:
        """Whether the prompt is text or chat messages that no one has tokenized yet."""
        return self.prompt_token_ids is None and self.job.prompt_token_ids is None


class Admission:
    """Thread-safe hand-off between sources (producers of work) and the step loop."""

    def __init__(self, prepare: bool = False, rank: Callable[[Work], int] | None = None,
                 read_ahead: int | None = None) -> None:
        """``read_ahead``: at most this many works handed in and not yet taken (None: as many as
        the capacity leaves room for)."""
        self._cond = threading.Condition()
        self._read_ahead = read_ahead
        self._prepare = prepare
        self._rank = rank or (lambda work: work.job.priority)  # higher first
        self._to_prepare: deque[Work] = deque()  # offered, waiting for the preparer
        self._preparing = 0  # taken by the preparer, not yet ready or failed
        self._ready: deque[Work] = deque()
        self._cancels: dict[str, str] = {}  # job id -> why: every cancel asked and not yet forgotten
        self._unseen: list[str] = []  # cancels asked since the step loop last took them
        self._capacity = 0
        self._open = True

    # --- source side --------------------------------------------------------------------------
    def _handed_in(self) -> int:
        return len(self._ready) + len(self._to_prepare) + self._preparing

    def _room(self) -> int:
        if not self._open:
            return 0
        handed_in = self._handed_in()
        room = self._capacity - handed_in
        if self._read_ahead is not None:
            room = min(room, self._read_ahead - handed_in)
        return max(0, room)

    def room(self) -> int:
        """Jobs the engine could take now, less those already handed in and not yet taken
        (and no more than the read-ahead leaves)."""
        with self._cond:
            return self._room()

    def wait_for_room(self, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: not self._open or self._room() > 0, timeout)
            return self._room()

    def offer(self, works: list[Work]) -> bool:
        """Hand ``works`` to the step loop; False (nothing taken) once admission is closed."""
        with self._cond:
            if not self._open:
                return False
            now = time.time()
            for work in works:
                if self._prepare and work.needs_tokens:
                    self._to_prepare.append(work)
                else:
                    work.ready_at = now
                    self._ready.append(work)
            self._cond.notify_all()
            return True

    # --- preparer side --------------------------------------------------------------------------
    def next_to_prepare(self, timeout: float) -> Work | None:
        """The work to tokenize next (None after ``timeout``, or at once once closed); call ``prepared`` after.

        NOTE: the highest rank (``worker/ranks.py``) first, then the oldest, so jobs read together
        reach the engine in the order the engine would have run them had they arrived together.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._to_prepare or not self._open, timeout) or not self._to_prepare:
                return None
            best = max(range(len(self._to_prepare)), key=lambda i: (self._rank(self._to_prepare[i]), -i))
            work = self._to_prepare[best]
            del self._to_prepare[best]
            self._preparing += 1
            return work

    def prepared(self, work: Work, ok: bool = True) -> bool:
        """Put prepared ``work`` in the ready queue (``ok``) or just forget it (it failed);
        False when admission closed meanwhile (the caller releases it)."""
        with self._cond:
            self._preparing -= 1
            self._cond.notify_all()  # room changed either way
            if not ok:
                return True
            if not self._open:
                return False
            work.ready_at = time.time()
            self._ready.append(work)
            return True

    def cancel(self, job_id: str, reason: str) -> bool:
        """Ask the step loop to cancel ``job_id``; False if that cancel is pending already."""
        with self._cond:
            if job_id in self._cancels:
                return False
            self._cancels[job_id] = reason
            self._unseen.append(job_id)
            self._cond.notify_all()
            return True

    @property
    def open(self) -> bool:
        return self._open

    # --- step-loop side -----------------------------------------------------------------------
    def set_capacity(self, capacity: int) -> None:
        with self._cond:
            grew = capacity > self._capacity
            self._capacity = capacity
            if grew:
                self._cond.notify_all()

    def take(self, limit: int, max_tokens: int | None = None) -> list[Work]:
        """Up to ``limit`` ready works, the highest rank first (then the oldest), and no more
        than ``max_tokens`` prompt tokens among them (at least one work, whatever its size).

        NOTE: ``max_tokens`` bounds one step-loop turn's ``add_request`` work: a backlog of
        long bulk prompts admitted in one turn kept an interactive job that arrived meanwhile
        waiting for all of them (a quarter of a second for 128 prompts of 4,096 tokens); the
        rank order lets that job in first at the next turn.
        """
        with self._cond:
            n = min(limit, len(self._ready))
            if n == 0:
                return []
            ready = list(self._ready)
            ranks = [self._rank(w) for w in ready]
            order = range(len(ready)) if min(ranks) == max(ranks) else sorted(range(len(ready)),
                                                                              key=lambda i: (-ranks[i], i))
            taken: list[int] = []
            tokens = 0
            for i in order:
                if len(taken) == n:
                    break
                tokens += _prompt_tokens(ready[i])
                if taken and max_tokens is not None and tokens > max_tokens:
                    break
                taken.append(i)
            chosen = set(taken)
            self._ready = deque(w for i, w in enumerate(ready) if i not in chosen)
            self._capacity = max(0, self._capacity - len(taken))  # taken work fills room until the next set_capacity
            return [ready[i] for i in taken]

    def take_cancels(self) -> dict[str, str]:
        """The cancels asked since the last call (job id -> why); they stay pending until forgotten."""
        with self._cond:
            unseen, self._unseen = self._unseen, []
            return {job_id: self._cancels[job_id] for job_id in unseen if job_id in self._cancels}

    def cancel_reason(self, job_id: str) -> str | None:
        """Why ``job_id`` is to be cancelled, or None: a job taken out of here checks this first."""
        with self._cond:
            return self._cancels.get(job_id)

    def forget_cancels(self, held: "Held") -> None:
        """Forget the cancels of jobs no longer held (ended, or given back)."""
        with self._cond:
            if self._cancels:
                self._cancels = {j: why for j, why in self._cancels.items() if j in held}

    def wait_for_work(self, timeout: float) -> None:
        """Block until work or a cancel arrives, or ``timeout`` passes."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._unseen, timeout)

    def close(self) -> list[Work]:
        """Stop accepting; return the work handed in and not yet taken (not the one in preparation)."""
        with self._cond:
            self._open = False
            left = list(self._ready) + list(self._to_prepare)
            self._ready.clear()
            self._to_prepare.clear()
            self._cond.notify_all()
            return left


class Held:
    """The deliveries one source holds (read and not yet acknowledged), by job id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: dict[str, Work] = {}

    def add(self, work: Work) -> bool:
        """Hold ``work``; False if this job is already held (a second delivery of it)."""
        with self._lock:
            if work.id in self._works:
                return False
            self._works[work.id] = work
            return True

    def get(self, job_id: str) -> Work | None:
        with self._lock:
            return self._works.get(job_id)

    def discard(self, work: Work) -> None:
        with self._lock:
            if self._works.get(work.id) is work:
                del self._works[work.id]

    def snapshot(self) -> list[Work]:
        with self._lock:
            return list(self._works.values())

    def __contains__(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._works

    def __len__(self) -> int:
        with self._lock:
            return len(self._works)


def _prompt_tokens(work: Work) -> int:
    """The tokens ``add_request`` will take in for ``work`` (text not yet tokenized: about 4 bytes a token)."""
    job = work.job
    ids = work.prompt_token_ids if work.prompt_token_ids is not None else job.prompt_token_ids
    count = len(ids) if ids is not None else len(job.prompt or "") // 4
    return count + len(work.resume_token_ids or ())
