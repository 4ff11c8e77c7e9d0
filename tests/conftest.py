"""Fixtures shared by every suite."""

import os
import shutil

# NOTE: Triton chooses compiled or interpreted when each kernel is defined, so on a machine
# without a GPU this must be set before anything imports triton (the engine does).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.redis_server import redis_client, redis_server, redis_server_factory  # noqa: F401
