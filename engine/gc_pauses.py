"""The garbage collector's part in step times: freezing the heap the engine's start-up built
(the worker does, for as long as it runs; so does ``bench grading``), and timing the collector's pauses.

A full collection walks every tracked object in the process. After start-up that is about
300,000 objects here (torch, transformers, triton, the block manager) and a full pass took
150-180 ms on this repository's CI machine; inside a step loop such a pass is a step that
stalls, and a worker that decodes thousands of jobs triggers several. Frozen objects are
never walked again (``gc.freeze``) until the last holder thaws them.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

_frozen_by = 0  # holders of the freeze (workers running, a bench), each thawing once
_thaw_at_exit = False
_lock = threading.Lock()


def freeze_startup_heap() -> int:
    """Collect the young generations, then move every object left to the permanent generation;
    returns how many.

    Call ``thaw_startup_heap`` when done (reference counting still frees a frozen object; only
    reference cycles among frozen objects wait for the thaw).

    NOTE: the process's owner calls it, not the engine: an engine dropped without shutdown is
    a reference cycle, and frozen it was never collected (a tensor-parallel one kept its ranks)."""
    global _frozen_by, _thaw_at_exit
    with _lock:
        if not _thaw_at_exit:
            # NOTE: a process that never thaws is thawed before the interpreter tears down, so its
            # last collection still frees the heap (native bindings then report no leaks)
            atexit.register(gc.unfreeze)
            _thaw_at_exit = True
        # NOTE: the young generations only: a full pass here cost a starting worker 150-180 ms
        # on the CI machine; what older garbage there is gets frozen with the rest, once
        gc.collect(1)
        gc.freeze()
        _frozen_by += 1
        return gc.get_freeze_count()


def thaw_startup_heap() -> None:
    """Undo one ``freeze_startup_heap``: once no holder is left, the collector walks the heap again."""
    global _frozen_by
    with _lock:
        if _frozen_by == 0:
            return
        _frozen_by -= 1
        if _frozen_by == 0:
            gc.unfreeze()


@dataclass
class GcPauses:
    """The collector's pauses while installed: count, seconds and the longest, per generation.

    ``on_pause(generation, seconds)`` is also called after each one (from the thread the
    collection ran on; it must be quick and must not allocate much)."""

    on_pause: Callable[[int, float], None] | None = None
    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _started: float | None = None

    def install(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def __enter__(self) -> "GcPauses":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # NOTE: one collection runs at a time (it holds the GIL), so start and stop pair up
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        seconds, self._started = time.perf_counter() - self._started, None
        gen = min(int(info.get("generation", 2)), 2)
        self.count[gen] += 1
        self.seconds[gen] += seconds
        self.longest[gen] = max(self.longest[gen], seconds)
        if self.on_pause is not None:
            self.on_pause(gen, seconds)

    def summary(self) -> dict[str, Any]:
        """``{"collections": [g0, g1, g2], "seconds": [...], "longest_ms": [...], "total_s": s}``."""
        return dict(collections=list(self.count), seconds=[round(s, 4) for s in self.seconds],
                    longest_ms=[round(1e3 * s, 2) for s in self.longest], total_s=round(sum(self.seconds), 4))
