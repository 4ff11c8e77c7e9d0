"""Fixtures shared by every suite."""

import os
import shutil

# NOTE: Triton chooses compiled or interpreted when each kernel is defined, so on a machine
# without a GPU this must be set before anything imports triton (the engine does).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import logging

import pytest

from tests.redis_server import redis_client, redis_server, redis_server_factory  # noqa: F401


@pytest.fixture
def restore_logging():
    """Commands configure the ``worker`` and ``engine`` loggers; give later tests them back."""
    saved = {name: (lg.handlers[:], lg.level, lg.propagate) for name in ("worker", "engine")
             for lg in [logging.getLogger(name)]}
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
