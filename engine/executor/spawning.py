"""Starting rank processes: a spawn that leaves the caller's script alone, a free local port."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import types
from collections.abc import Iterator

_spawn_lock = threading.Lock()


@contextlib.contextmanager
def main_left_alone() -> Iterator[None]:
    """While a rank is started, let its spawn see a blank ``__main__``.

    NOTE: a spawned child first re-runs the parent's main module (as ``__mp_main__``) when
    the parent's ``__main__`` names a file or a module. A rank needs nothing from it --
    its target and arguments live in ``engine`` -- and re-running an unguarded script
    would build a second ``LLM`` inside the rank, which multiprocessing refuses. So the
    preparation data is made while ``sys.modules["__main__"]`` is an empty module; it is
    put back as soon as ``start()`` has written that data, under a lock.
    """
    with _spawn_lock:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is None:
                sys.modules.pop("__main__", None)
            else:
                sys.modules["__main__"] = main


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

