"""The loop of tensor-parallel ranks 1..N-1, each in its own spawned process.

A rank joins the group, builds its shard of the model and its KV cache, then runs every
step rank 0 sends it until told to stop. Its logits are not needed (rank 0 samples). It
exits on its own when the parent process dies, and an exception is sent to rank 0 as
its traceback text before the rank exits (a model whose files cannot be found: the
loader's message alone, marked so that rank 0 raises it as ``ModelNotFound``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait

import torch

from engine.executor import step_wire
from engine.executor.distributed import destroy_tensor_parallel, init_tensor_parallel
from engine.config import EngineConfig
from engine.errors import ModelNotFound
from engine.runner.model_runner import ModelRunner, StepInputs

_MAX_REPORT_CHARS = 16_000
MODEL_NOT_FOUND = "model-not-found"  # a report's kind, after its time: the text is the loader's message


def rank_main(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    """Process entry of rank ``rank`` (spawned by ``MultiprocExecutor``)."""
    _exit_with_parent()
    # NOTE: Ctrl-C reaches every process of the terminal's group, and a service manager may
    # send SIGTERM to every process of the service; rank 0 handles both (the worker drains)
    # and then stops the ranks, which must not die first. A rank exits when rank 0 closes its
    # pipe or dies; rank 0's shutdown kills a rank that does not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _serve(rank, config, init_method, conn)
    except ModelNotFound as exc:  # the message says which files and where; the stack adds nothing
        _report(conn, time.monotonic(), str(exc), MODEL_NOT_FOUND)
        _exit(1)
    except BaseException:  # noqa: BLE001 - every failure goes to rank 0 with its traceback
        _report(conn, time.monotonic(), traceback.format_exc())
        _exit(1)
    _exit(0)


def _serve(rank: int, config: EngineConfig, init_method: str, conn: Connection) -> None:
    world = config.parallel.tensor_parallel_size
    on_gpu = config.model.device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
        # NOTE: a GPU rank's host work is a few small copies a step; an intra-op thread pool
        # as wide as the machine only adds wake-ups and contends with rank 0's.
        torch.set_num_threads(1)
    else:
        # NOTE: the ranks share the host's cores; N ranks each with every core would thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    conn.send_bytes(b"")  # about to join: rank 0 may start its own rendezvous
    init_tensor_parallel(rank, world, "nccl" if on_gpu else "gloo", init_method, config.symmetric_all_reduce())
    runner = ModelRunner(config, rank=rank)
    while True:
        try:
            message = bytearray(conn.recv_bytes())
        except (EOFError, OSError):
            break  # rank 0 is gone
        op, args, _ = step_wire.decode_op(message)
        if op == step_wire.OP_STEP:
            runner.execute(step_wire.decode_step(StepInputs, message, runner.device))
        elif op == step_wire.OP_RESIZE_SWAP:
            runner.resize_swap_pool(args[0])
        elif op == step_wire.OP_STOP:
            break
        else:
            raise ValueError(f"rank {rank}: unknown op {op} from rank 0")
    runner.release_graphs()  # before leaving the group: see DecodeGraphs.release
    destroy_tensor_parallel()


def _exit_with_parent() -> None:
    """Exit this process as soon as the process that spawned it dies, whatever this one is doing.

    The main thread may be blocked in a collective that will never finish once rank 0 is
    gone (NCCL does not notice a dead peer), so a daemon thread watches the parent.
    """
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        _exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _report(conn: Connection, when: float, text: str, kind: str = "") -> None:
    """Send the failure to rank 0: the time it happened (the host's monotonic clock, so
    rank 0 can tell the first failure from the peers that failed because of it), a space,
    its kind (empty for a plain exception), a newline, the traceback (or the kind's text)."""
    if len(text) > _MAX_REPORT_CHARS:  # a pipe's buffer holds it, so the rank never blocks on exit
        text = "...\n" + text[-_MAX_REPORT_CHARS:]
    try:
        conn.send_bytes(f"{when!r} {kind}\n{text}".encode("utf-8", "replace"))
    except OSError:
        sys.stderr.write(text)  # nobody is listening; leave it in the rank's log


def _exit(code: int) -> None:
    # NOTE: os._exit skips interpreter teardown, which can block on a process group whose
    # peers are gone; flush what the rank printed first.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
