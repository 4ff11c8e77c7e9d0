"""Where one thread's time goes in a stretch of wall time: its Python stack, sampled from
another thread every few milliseconds (``sys._current_frames``), summarised per window.

A stall that a profiler of the whole run would average away (one engine call of a second
among seventy) shows here as the lines the thread sat on inside that call. The sampler
needs the GIL to take a sample, so a thread that holds the GIL in one long C call shows as
samples missing from the window (``samples`` well under ``seconds / interval``). Each
sample also reads the thread's CPU clock (``time.pthread_getcpuclockid``, where the
platform has it), so a window says how much CPU the thread burned in it (``cpu_s``): a
step loop that sat in a launch with little CPU was waiting (on the GIL, a lock, the
driver), and the other thread with the most CPU meanwhile is the likely holder.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any


class StackSampler:
    """Samples the innermost ``depth`` frames of every thread whose name starts with ``prefix``,
    every ``interval_s`` for ``duration_s``."""

    def __init__(self, prefix: str = "sluiceway", interval_s: float = 0.002, duration_s: float = 3.0,
                 depth: int = 6) -> None:
        self.prefix = prefix
        self.interval_s = interval_s
        self.duration_s = duration_s
        self.depth = depth
        # (time.time(), thread, innermost frame first, the thread's CPU seconds so far or None)
        self.samples: list[tuple[float, str, tuple[str, ...], float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluiceway-stack-sampler", daemon=True)

    def start(self) -> "StackSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        end = time.monotonic() + self.duration_s
        me = threading.get_ident()
        while not self._stop.is_set() and time.monotonic() < end:
            names = {t.ident: t.name for t in threading.enumerate() if t.name.startswith(self.prefix) and t.ident != me}
            now = time.time()
            for ident, frame in sys._current_frames().items():
                if ident not in names:
                    continue
                stack = []
                while frame is not None and len(stack) < self.depth:
                    code = frame.f_code
                    stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
                    frame = frame.f_back
                self.samples.append((now, names[ident], tuple(stack), _cpu_seconds(ident)))
            time.sleep(self.interval_s)

    def window(self, start: float, end: float, thread: str, top: int = 3) -> dict[str, Any]:
        """``thread``'s samples between two ``time.time()`` readings: how many, and its most common stacks."""
        mine = [(t, stack, cpu) for t, name, stack, cpu in self.samples if name == thread]
        inside = [stack for t, stack, _ in mine if start <= t <= end]
        common = Counter(inside).most_common(top)
        return dict(thread=thread, seconds=round(end - start, 4), samples=len(inside), cpu_s=_cpu_between(mine, start, end),
                    stacks=[dict(share=round(n / len(inside), 3), frames=list(stack)) for stack, n in common])

    def shares(self, thread: str, start: float, end: float, names: tuple[str, ...]) -> dict[str, float]:
        """Where ``thread`` was over a stretch: the share of its samples under each function of
        ``names`` (the innermost of them on the stack counts), the rest as "other"."""
        counts: Counter = Counter()
        for t, name, stack, _ in self.samples:
            if name != thread or not start <= t <= end:
                continue
            functions = [frame.rsplit(" ", 1)[-1] for frame in stack]
            counts[next((f for f in functions if f in names), "other")] += 1
        total = sum(counts.values())
        return {name: round(n / total, 3) for name, n in counts.most_common()} if total else {}

    def busiest(self, start: float, end: float, exclude: str, top: int = 2) -> list[dict[str, Any]]:
        """The other threads' windows over the same stretch, those with most samples off a wait first."""
        waits = ("wait", "select", "poll", "sleep", "_read_from_socket", "read_response", "acquire")
        names = {name for t, name, _, _ in self.samples if start <= t <= end and name != exclude}
        windows = [self.window(start, end, name) for name in names]
        if windows and all(w["cpu_s"] is not None for w in windows):  # NOTE: the CPU clocks say who worked
            busy = [w for w in windows if w["cpu_s"] >= 0.05 * w["seconds"]]  # a twentieth of the window or more
            return sorted(busy, key=lambda w: -w["cpu_s"])[:top]
        busy = [w for w in windows if w["stacks"] and not any(k in w["stacks"][0]["frames"][0] for k in waits)]
        return sorted(busy, key=lambda w: -w["samples"])[:top]


def _cpu_seconds(ident: int) -> float | None:
    """The CPU seconds thread ``ident`` (a ``threading`` ident) has used, where the platform says."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, ValueError):  # not POSIX, or the thread just ended
        return None


def _cpu_between(samples: list[tuple[float, tuple[str, ...], float | None]], start: float, end: float) -> float | None:
    """CPU seconds a thread used from its last sample at or before ``start`` to its first at or
    after ``end`` (a window a little wider than asked: samples are ``interval_s`` apart)."""
    before = [(t, cpu) for t, _, cpu in samples if t <= start and cpu is not None]
    after = [(t, cpu) for t, _, cpu in samples if t >= end and cpu is not None]
    if not before or not after:
        inside = [cpu for t, _, cpu in samples if start <= t <= end and cpu is not None]
        return round(inside[-1] - inside[0], 6) if len(inside) > 1 else None
    return round(after[0][1] - before[-1][1], 6)
