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
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from engine.executor import step_wire
from engine.executor.spawning import free_port
from engine.executor.distributed import destroy_tensor_parallel, init_tensor_parallel, tp_size
from engine.config import EngineConfig
from engine.errors import ModelNotFound
from engine.runner.model_runner import ModelRunner, StepInputs
from engine.executor.ranks import FAILURE_GRACE_S, RankError, Ranks
from engine.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

# NOTE: the GPU hosts we run on need NVLink multicast off for NCCL and symmetric memory;
# set for rank 0 here and inherited by the spawned ranks (an operator's own value wins).
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_HOST = torch.device("cpu")


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
        self._ranks = Ranks(config, init_method, abort_on_failure=backend == "nccl")
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
            failure = self._ranks.failure(FAILURE_GRACE_S if waits else 0.0)
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
            failure = self._ranks.failure(FAILURE_GRACE_S)
        result = failure or err
        self._broken = result if isinstance(result, Exception) else RuntimeError(repr(result))
        self._ranks.out_of_step = True
        return result


def _close(ranks: Ranks, runners: list[ModelRunner]) -> None:
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
