"""The interpreter's thread switch interval while a worker runs (``Worker.work`` turns it on and off)."""

from __future__ import annotations

import sys
import threading

# NOTE: the interpreter's thread switch interval while the worker runs (Python's default is 5 ms).
# torch lets go of the GIL in every op the step loop launches, and while the intake thread
# parses jobs it holds the GIL until the interval forces it off: each launch then waited up to
# the interval, and the first step of a 2,048-job grading run took 0.79 s to launch (the engine
# alone: 0.05 s). A short interval bounds that wait; the intake's own work only slows.
SWITCH_INTERVAL_S = 0.0005
_switching = {"workers": 0, "interval": 0.005}  # workers running in this process, the interval before the first
_switching_lock = threading.Lock()


def fast_switching(on: bool) -> None:
    """Shorten the switch interval while any worker of this process runs; the last to stop restores it."""
    with _switching_lock:
        if on:
            if _switching["workers"] == 0:
                _switching["interval"] = sys.getswitchinterval()
                sys.setswitchinterval(min(_switching["interval"], SWITCH_INTERVAL_S))
            _switching["workers"] += 1
        elif _switching["workers"] > 0:
            _switching["workers"] -= 1
            if _switching["workers"] == 0:
                sys.setswitchinterval(_switching["interval"])
