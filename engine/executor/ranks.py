"""The spawned tensor-parallel ranks 1..N-1 of a ``MultiprocExecutor``: their processes and
pipes, a thread that watches them die, the failure each reports (``RankError``; a model whose
files cannot be found marked as such), and their stop."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
from multiprocessing.connection import Connection, wait
from typing import NamedTuple

import torch.distributed as dist

from engine.config import EngineConfig
from engine.executor import step_wire
from engine.executor.rank_worker import MODEL_NOT_FOUND, rank_main
from engine.executor.spawning import main_left_alone

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 3.0  # how long a failed collective waits for the failed rank's report
_STOP_TIMEOUT_S = 10.0


class RankError(RuntimeError):
    """A tensor-parallel rank failed; the message carries its traceback or exit status."""

    def __init__(self, rank: int, pid: int | None, detail: str, model_not_found: bool = False) -> None:
        super().__init__(f"tensor-parallel rank {rank} (pid {pid}) failed:\n{detail}")
        self.rank, self.pid, self.detail = rank, pid, detail
        self.model_not_found = model_not_found  # the rank raised ModelNotFound; ``detail`` is its message


class Ranks:
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
                self.procs[i].join(FAILURE_GRACE_S)
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
