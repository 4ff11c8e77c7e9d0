"""Fixtures shared by every suite."""

import os
import shutil

# NOTE: Triton chooses compiled or interpreted when each kernel is defined, so on a machine
# without a GPU this must be set before anything imports triton (the engine does).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import dataclasses

    from triton.runtime import interpreter

    # NOTE: the interpreter works out an int64 overflow check beside every integer add, sub
    # and mul of every program, then drops it unread: its device_assert fires only under
    # options.debug, which the interpreter's fixed options leave off. A third of an interpreted
    # engine step went to it (tests/engine/test_kv_cache_dtype.py's triton case: 26 s, 17 s
    # without); nothing a test checks changes.
    _options = interpreter.interpreter_builder.options
    if getattr(_options, "sanitize_overflow", False) and not _options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(_options, sanitize_overflow=False)

import logging

import pytest

from tests.redis_server import redis_client, redis_server, redis_server_factory  # noqa: F401

# NOTE: the files that take longest run first, longest first (the slowest durations of two CI
# runs beside other work, summed per file: 15-180 s each): with the suite split over processes
# file by file (scripts/test.sh), a long file that starts last keeps the run going while the
# other process is idle; the ~130 files left take seconds each, few more than 15.
SLOW_FIRST = (
    "tests/worker/test_held_up.py",
    "tests/engine/executor/test_tensor_parallel.py",
    "tests/worker/test_resume.py",
    "tests/worker/test_process.py",
    "tests/kernels/test_compile_check.py",
    "tests/gateway/test_resilience.py",
    "tests/engine/test_kv_cache_dtype.py",
    "tests/worker/test_demo_and_bench.py",
    "tests/bench/test_bench.py",
    "tests/engine/runner/test_prefill_graphs.py",
    "tests/engine/test_fp8_kv_scales.py",
    "tests/gateway/test_batch_recovery.py",
    "tests/producers/test_client.py",
    "tests/engine/test_vllm_examples.py",
    "tests/engine/test_swap.py",
    "tests/bench/test_kernels.py",
    "tests/engine/test_fp8.py",
    "tests/worker/test_acl_worker.py",
    "tests/worker/test_fencing.py",
    "tests/gateway/test_cluster.py",
    "tests/engine/test_fp8_checkpoints.py",
    "tests/worker/test_hostile_jobs.py",
    "tests/worker/test_cluster.py",
    "tests/kernels/test_pdl.py",
    "tests/worker/test_celery_recovery.py",
    "tests/worker/test_sentinel_failover.py",
    "tests/gateway/test_openai.py",
    "tests/gateway/test_shared_reads.py",
    "tests/bench/test_fleet.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))  # stable: the rest keep their order


@pytest.fixture
def restore_logging():
    """Commands configure the ``worker`` and ``engine`` loggers; give later tests them back."""
    saved = {name: (lg.handlers[:], lg.level, lg.propagate) for name in ("worker", "engine")
             for lg in [logging.getLogger(name)]}
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
