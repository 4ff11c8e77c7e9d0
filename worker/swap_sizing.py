"""The swap pool follows the queue: a pure sizing rule, and the component that applies it."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from worker.logs import event

log = logging.getLogger(__name__)

MIB = 1 << 20
GRANULE = 256 * MIB


def swap_pool_bytes(backlog: int, recent_kv_bytes_per_job: float, floor: int, cap: int,
                    granule: int = GRANULE, *, gpu_kv_bytes: int = 0, max_jobs_in_engine: int | None = None) -> int:
    """Bytes of CPU swap pool for ``backlog`` jobs whose KV cache is about ``recent_kv_bytes_per_job``.

    Why this rule:

    * The pool holds the KV blocks of sequences the scheduler preempted. It preempts when
      more work wants to run than the GPU cache holds, and the worker keeps the engine as
      full as the queues allow -- so the work that can be parked at once grows with the
      backlog and is bounded by it. With ``backlog`` jobs running or waiting for this
      worker, at most that many sequences are ever swapped out, each holding about the KV
      of a recent job.
    * Only jobs inside the engine can be parked: the worker hands it at most
      ``max_jobs_in_engine`` (the rest wait in Redis and hold no KV). And only what the GPU
      cache (``gpu_kv_bytes``) cannot hold is ever parked: a backlog whose KV fits on the
      GPU never preempts. So demand = min(backlog, max_jobs_in_engine) x recent KV bytes per
      job - gpu_kv_bytes, an upper bound on what is swapped out at once.
    * A drained queue needs no swap, but the ``floor`` stays so that a burst arriving
      between two resizes can still be preempted by swapping rather than by recompute.
    * The ``cap`` protects the host: the pool is pinned memory, which the OS can neither page
      out nor reclaim, and a host starved of memory takes the worker down with it.
    * The size is rounded up to ``granule`` so that small moves of the backlog do not each
      allocate or free pinned memory (slow: a resize costs far more than a step).

    Returns ``min(cap, max(floor, demand rounded up to a granule))``. All sizes are per GPU.
    """
    if backlog < 0 or recent_kv_bytes_per_job < 0 or floor < 0 or cap < 0 or granule <= 0 or gpu_kv_bytes < 0:
        raise ValueError(
            f"swap_pool_bytes needs non-negative inputs and a positive granule, got backlog={backlog}, "
            f"recent_kv_bytes_per_job={recent_kv_bytes_per_job}, floor={floor}, cap={cap}, granule={granule}, "
            f"gpu_kv_bytes={gpu_kv_bytes}"
        )
    if max_jobs_in_engine is not None:
        backlog = min(backlog, max_jobs_in_engine)
    demand = max(0.0, backlog * recent_kv_bytes_per_job - gpu_kv_bytes)
    rounded = math.ceil(demand / granule) * granule
    return int(min(cap, max(floor, rounded)))


class SwapSizer:
    """Applies ``swap_pool_bytes`` to the live backlog (``--swap-space auto``), from the step loop.

    Sizes are per GPU, as ``--swap-space`` and ``LLMEngine.resize_swap_pool`` count them.

    The pool grows as soon as the target rises (a deep queue is about to preempt) and shrinks
    only once the target has stayed lower for ``shrink_after_s`` (a queue that drains for a
    moment between bursts keeps its pool), to the largest target seen in that time.
    """

    def __init__(self, floor: int, cap: int, kv_bytes_per_token: int, prior_tokens_per_job: int,
                 every_s: float = 1.0, shrink_after_s: float = 30.0, granule: int = GRANULE,
                 gpu_kv_bytes: int = 0, max_jobs_in_engine: int | None = None) -> None:
        self.floor = floor
        self.cap = cap
        self.gpu_kv_bytes = gpu_kv_bytes
        self.max_jobs_in_engine = max_jobs_in_engine
        self.kv_bytes_per_token = kv_bytes_per_token
        self.tokens_per_job = float(prior_tokens_per_job)  # moving average over finished jobs
        self.every_s = every_s
        self.shrink_after_s = shrink_after_s
        self.granule = granule
        self.current: int | None = None  # what the engine reported after the last resize
        self.requested: int | None = None  # what the last resize asked for
        self.last_target = 0
        self._next_at = 0.0
        self._low_since: float | None = None
        self._low_max = 0
        # what resizing cost the step loop, which it stalls (unpinning host memory is slow)
        self.num_resizes = 0
        self.resize_s_total = 0.0
        self.resize_s_max = 0.0

    def observe_job(self, num_tokens: int) -> None:
        """Feed the KV length (prompt + generated tokens) of a finished job."""
        self.tokens_per_job += 0.1 * (num_tokens - self.tokens_per_job)

    def target(self, backlog: int) -> int:
        kv_per_job = self.tokens_per_job * self.kv_bytes_per_token
        return swap_pool_bytes(backlog, kv_per_job, self.floor, self.cap, self.granule,
                               gpu_kv_bytes=self.gpu_kv_bytes, max_jobs_in_engine=self.max_jobs_in_engine)

    def tick(self, engine: Any, backlog: int, now: float | None = None) -> int | None:
        """Resize the engine's pool if the policy says so; return the new size, or None."""
        now = time.monotonic() if now is None else now
        if now < self._next_at:
            return None
        self._next_at = now + self.every_s
        target = self.last_target = self.target(backlog)
        if self.requested is not None and target < self.requested:
            if self._low_since is None:
                self._low_since, self._low_max = now, target
            self._low_max = max(self._low_max, target)
            if now - self._low_since < self.shrink_after_s:
                return None
            target = self._low_max
        self._low_since = None
        if target == self.requested and (self.current is None or self.current <= target):
            return None  # NOTE: a shrink the engine could not finish (blocks in use) is retried
        return self._resize(engine, target, backlog)

    def _resize(self, engine: Any, target: int, backlog: int) -> int | None:
        before = self.current
        started = time.perf_counter()
        try:
            self.current = int(engine.resize_swap_pool(target))
            self.requested = target
        except Exception as exc:  # the engine keeps its old pool; try again next interval
            event(log, "swap.resize_failed", logging.WARNING, target_bytes=target, error=str(exc))
            return None
        finally:
            took = time.perf_counter() - started
            self.num_resizes += 1
            self.resize_s_total += took
            self.resize_s_max = max(self.resize_s_max, took)
        if self.current == before:
            return None
        event(log, "swap.resized", from_bytes=before, to_bytes=self.current, target_bytes=target, backlog=backlog,
              kv_bytes_per_job=int(self.tokens_per_job * self.kv_bytes_per_token))
        return self.current
