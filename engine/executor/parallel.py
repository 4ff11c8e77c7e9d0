"""``MultiprocExecutor``: one model shard per local device, rank 0 in the caller's process.

Ranks 1..N-1 are spawned processes (``engine.executor.rank_worker``); rank 0 builds its runner
here and runs the scheduler. Each step rank 0 builds the step's tensors on the host,
sends them to every other rank as one flat message over that rank's pipe
(``engine.executor.step_wire``: raw tensor bytes, nothing pickled) and runs its own shard; the
layers' collectives (NCCL on GPUs, gloo on CPU) keep the ranks in lockstep.

NOTE: pipes rather than a broadcast over the process group: a rank waits on its pipe
for as long as the engine idles, where a collective would time out, and a closed pipe
tells it at once that rank 0 is gone.

Ranks exit when the executor shuts down (``LLM.shutdown()``, a ``with`` block, or garbage
collection) and when the parent process dies, however it dies. A rank that fails sends
its traceback to rank 0, where the next call raises ``RankError`` carrying it; a model whose
files cannot be found is ``ModelNotFound`` whichever rank finds that, as with one rank.

Ranks are spawned without re-running the caller's main module (see ``main_left_alone``),
so a script with no ``if __name__ == "__main__":`` guard, a notebook and ``python -c`` all
build a tensor-parallel ``LLM`` the same way.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from engine.executor import step_wire
from engine.executor.spawning import free_port, main_left_alone
from engine.executor.distributed import destroy_tensor_parallel, init_tensor_parallel, tp_size
from engine.config import EngineConfig
from engine.errors import ModelNotFound
from engine.runner.model_runner import ModelRunner, StepInputs
from engine.executor.rank_worker import MODEL_NOT_FOUND, rank_main
from engine.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

# NOTE: the GPU hosts we run on need NVLink multicast off for NCCL and symmetric memory;
# set for rank 0 here and inherited by the spawned ranks (an operator's own value wins).
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_HOST = torch.device("cpu")
_FAILURE_GRACE_S = 3.0  # how long a failed collective waits for the failed rank's report
_STOP_TIMEOUT_S = 10.0


class RankError(RuntimeError):
    """A tensor-parallel rank failed; the message carries its traceback or exit status."""

    def __init__(self, rank: int, pid: int | None, detail: str, model_not_found: bool = False) -> None:
        super().__init__(f"tensor-parallel rank {rank} (pid {pid}) failed:\n{detail}")
        self.rank, self.pid, self.detail = rank, pid, detail
        self.model_not_found = model_not_found  # the rank raised ModelNotFound; ``detail`` is its message


class MultiprocExecutor:
    """Tensor parallel size N > 1: rank 0 here, ranks 1..N-1 in spawned processes."""

    def __init__(self, config: EngineConfig) -> None:
        if tp_size() != 1:
            raise RuntimeError(
                f"a tensor-parallel engine (size {tp_size()}) is already live in this process; "
                "shut it down (LLM.shutdown()) before building another"
            )
        for key, value in RANK_ENV.items():
            os.environ.setdefault(key, value)
        self.config = config
        self.runner = None
        self._broken: Exception | None = None
        tp, device = config.parallel.tensor_parallel_size, config.model.device
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._ranks = _Ranks(config, init_method, abort_on_failure=backend == "nccl")
        # NOTE: the finalizer holds the ranks, not the executor, so an engine that is
        # dropped without shutdown() is still collected and its ranks stopped.
        self._runners: list[ModelRunner] = []  # rank 0's, once built, for the finalizer to release its graphs
        self._finalizer = weakref.finalize(self, _close, self._ranks, self._runners)
        try:
            self._ranks.wait_started()
            if backend == "nccl":
                torch.cuda.set_device(0)
            init_tensor_parallel(0, tp, backend, init_method, config.symmetric_all_reduce())
            self.runner = ModelRunner(config, rank=0)
            self._runners.append(self.runner)
        except BaseException as err:
            # NOTE: every rank reads the same files, so rank 0's own ModelNotFound says it all. Any
            # other failure here (a failed collective most often) usually means a rank failed: wait for its report.
            waits = isinstance(err, Exception) and not isinstance(err, (RankError, ModelNotFound))
            failure = self._ranks.failure(_FAILURE_GRACE_S if waits else 0.0)
            self._ranks.out_of_step = True  # they may wait in a collective rank 0 never joins
            self._finalizer()
            if isinstance(err, RankError):
                failure = err
            if isinstance(err, ModelNotFound) or failure is None:
                raise
            if failure.model_not_found:  # as one rank would say it, so callers tell it apart the same way
                raise ModelNotFound(failure.detail) from failure
            if failure is err:
                raise
            raise failure from err
        self.num_gpu_blocks = self.runner.num_gpu_blocks
        self.num_cpu_blocks = self.runner.num_cpu_blocks
        logger.info("tensor parallel: %d ranks over %s (%s); rank pids %s", tp, backend, device.type,
                    self._ranks.pids)

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return self._ranks.pids

    def execute(self, out: SchedulerOutput, fed_tokens: torch.Tensor | None = None,
                between: Callable[[], object] | None = None) -> torch.Tensor | None:
        """Send the step to the ranks and launch rank 0's part; returns without waiting for
        the GPU, so a step may be in flight while the next is prepared (async scheduling).
        ``between`` is never given: the express lane is for one GPU."""
        self._check_usable()
        message = step_wire.encode_step(self.runner.prepare(out, _HOST))
        try:
            self._ranks.send(message)
            # NOTE: rank 0 decodes the message too, so every rank runs on the same bytes.
            inputs = step_wire.decode_step(StepInputs, message, self.runner.device)
            logits = self.runner.execute(inputs, fed_tokens)
        except BaseException as err:
            failure = self._fail(err)
            if failure is err:
                raise
            raise failure from err
        failure = self._ranks.failure(0.0)
        if failure is not None:
            raise self._fail(failure)
        return logits

    def check(self) -> None:
        """Raise a failed rank's error. NOTE: on NCCL a dead rank is seen by the watcher,
        which aborts the collectives; a step then "finishes" with garbage, so the engine calls
        this once a step's results are read back and before it uses them."""
        self._check_usable()
        failure = self._ranks.failure(0.0)
        if failure is not None:
            raise self._fail(failure)

    def resize_swap_pool(self, num_blocks: int) -> int:
        """Resize every rank's swap pool (each holds its shard of every block)."""
        self._check_usable()
        try:
            self._ranks.send(step_wire.encode_op(step_wire.OP_RESIZE_SWAP, num_blocks))
            self.num_cpu_blocks = self.runner.resize_swap_pool(num_blocks)
        except BaseException as err:
            failure = self._fail(err)
            if failure is err:
                raise
            raise failure from err
        return self.num_cpu_blocks

    @property
    def forward_path(self) -> str | None:
        return self.runner.last_forward if self.runner is not None else None

    @property
    def logit_stats(self) -> Any:
        return self.runner.last_logit_stats if self.runner is not None else None

    def shutdown(self) -> None:
        """Stop the ranks, leave the process group and free rank 0's cache."""
        self._finalizer()
        self.runner = None

    # ----- failures -------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.runner is None:
            raise RuntimeError("the engine is shut down")
        if self._broken is not None:
            raise RuntimeError(
                f"the tensor-parallel ranks are out of step after an earlier failure ({self._broken}); "
                "build a new engine"
            ) from self._broken

    def _fail(self, err: BaseException) -> BaseException:
        """The exception to raise for a failed step: the failed rank's, else ``err``.

        Either way the ranks may be mid-step, so the executor is unusable afterwards.
        """
        failure = err if isinstance(err, RankError) else None
        if failure is None and isinstance(err, Exception):
            failure = self._ranks.failure(_FAILURE_GRACE_S)
        result = failure or err
        self._broken = result if isinstance(result, Exception) else RuntimeError(repr(result))
        self._ranks.out_of_step = True
        return result


class _Ranks:
    """The spawned rank processes and their pipes; a thread watches them die."""

    def __init__(self, config: EngineConfig, init_method: str, abort_on_failure: bool):
        ctx = mp.get_context("spawn")
        self.procs: list = []
        self.conns: list[Connection] = []
        self._failures: dict[int, tuple[tuple, _Report]] = {}  # rank -> (order, what it said or how it ended)
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._abort_on_failure = abort_on_failure
        self.closing = False
        self.out_of_step = False  # a step failed part-way: the ranks may sit in a collective
        try:
            for rank in range(1, config.parallel.tensor_parallel_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=rank_main, args=(rank, config, init_method, theirs),
                                   name=f"sluiceway-tp{rank}", daemon=True)
                with main_left_alone():
                    proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        except BaseException:
            self.kill()
            raise
        self._watcher = threading.Thread(target=self._watch, name="watch-tp-ranks", daemon=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_started(self) -> None:
        """Block until every rank is about to join the group; raise if one dies before that.

        NOTE: rank 0's rendezvous would wait out the whole store timeout for a rank that
        died before joining; this wait ends as soon as one dies. The watcher thread starts
        afterwards, so that only one thread ever reads a rank's pipe at a time.
        """
        pending = set(range(len(self.procs)))
        while pending:
            handles = {self.conns[i]: i for i in pending} | {self.procs[i].sentinel: i for i in pending}
            for ready in wait(list(handles)):
                i = handles[ready]
                if i not in pending:
                    continue
                report = None
                if ready is self.conns[i]:
                    try:
                        message = ready.recv_bytes()
                    except (EOFError, OSError):
                        message = None
                    if message == b"":  # the rank's "joining" note
                        pending.discard(i)
                        continue
                    report = _parse_report(message) if message else None
                self.procs[i].join(_FAILURE_GRACE_S)
                report = report or self._read_report(i) or _Report.of_exit(self.procs[i])
                raise report.error(i + 1, self.procs[i].pid)
        self._watcher.start()

    def send(self, message: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(message)

    def failure(self, timeout: float) -> RankError | None:
        """The first rank's failure, waiting up to ``timeout`` s for one to be reported.

        NOTE: one rank's failure makes its peers fail in their next collective; the first
        is the one worth raising, so failures are ordered by when the watcher saw them,
        then (among those seen together) deaths without a report first (killed, crashed:
        their peers always report), then by when each rank's exception happened.
        """
        if timeout > 0:
            self._failed.wait(timeout)
        with self._lock:
            if not self._failures:
                return None
            rank = min(self._failures, key=lambda r: self._failures[r][0])
            return self._failures[rank][1].error(rank, self.procs[rank - 1].pid)

    def stop(self) -> None:
        """Ask every rank to finish, then kill any that has not after a timeout."""
        self.closing = True
        message = step_wire.encode_op(step_wire.OP_STOP)
        for conn in self.conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(_STOP_TIMEOUT_S)
        self.kill()

    def kill(self) -> None:
        self.closing = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()

    # ----- the watcher thread -----------------------------------------------------------
    def _watch(self) -> None:
        alive = {proc.sentinel: i for i, proc in enumerate(self.procs)}
        seen = 0
        while alive:
            found = {}
            for ready in wait(list(alive)):
                i = alive.pop(ready)
                if self.closing:
                    continue
                report = self._read_report(i)
                if report is None:
                    found[i + 1] = ((seen, 0, 0.0), _Report.of_exit(self.procs[i]))
                else:
                    found[i + 1] = ((seen, 1, report.when), report)
            seen += 1
            if found:
                with self._lock:
                    for rank, failure in found.items():
                        self._failures.setdefault(rank, failure)
                self._failed.set()
                if self._abort_on_failure and not self.closing:
                    _abort_collectives()

    def _read_report(self, i: int) -> _Report | None:
        """The report rank ``i + 1`` sent before exiting, if any (in the pipe by now)."""
        conn = self.conns[i]
        try:
            while conn.poll():
                message = conn.recv_bytes()
                if message:
                    return _parse_report(message)
        except (EOFError, OSError):
            pass
        return None


class _Report(NamedTuple):
    """What a failed rank said (``rank_worker._report``), or how it ended without a word."""

    when: float  # the host's monotonic clock when the rank failed
    detail: str  # its traceback, its kind's text, or its exit status
    kind: str = ""  # "" or ``rank_worker.MODEL_NOT_FOUND``

    @classmethod
    def of_exit(cls, proc) -> _Report:
        return cls(0.0, _exit_detail(proc))

    def error(self, rank: int, pid: int | None) -> RankError:
        return RankError(rank, pid, self.detail, model_not_found=self.kind == MODEL_NOT_FOUND)


def _parse_report(message: bytes) -> _Report:
    """A rank's failure report: ``when`` (monotonic clock), a space, its kind, newline, traceback."""
    head, _, text = message.decode("utf-8", "replace").partition("\n")
    when, _, kind = head.partition(" ")
    try:
        return _Report(float(when), text, kind)
    except ValueError:
        return _Report(float("inf"), head + "\n" + text)


def _exit_detail(proc) -> str:
    proc.join(1.0)
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without a report"


def _abort_collectives() -> None:
    """Abort the NCCL communicators so that rank 0, stuck waiting on a dead peer, returns."""
    try:
        group = dist.distributed_c10d._get_default_group()
        group.abort()
    except Exception:  # noqa: BLE001 - best effort: the group may be gone or not support it
        logger.debug("could not abort the process group", exc_info=True)


def _close(ranks: _Ranks, runners: list[ModelRunner]) -> None:
    """Stop the ranks, release rank 0's graphs and leave the group (the executor's finalizer; runs once)."""
    if ranks.out_of_step or ranks.failure(0.0) is not None:
        ranks.kill()
    else:
        ranks.stop()
    for runner in runners:
        try:
            runner.release_graphs()  # before leaving the group: see DecodeGraphs.release
        except Exception:  # noqa: BLE001 - after a failed step the device may refuse; leaving is bounded anyway
            logger.debug("releasing rank 0's cuda graphs failed", exc_info=True)
    runners.clear()
    try:
        destroy_tensor_parallel()
    except Exception:  # noqa: BLE001 - a group whose peers died may not tear down cleanly
        logger.debug("process group teardown failed", exc_info=True)
