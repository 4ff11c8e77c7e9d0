"""Executors run a scheduled step on every rank and hand rank 0's logits back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput


class Executor(Protocol):
    num_gpu_blocks: int
    num_cpu_blocks: int

    def execute(self, out: SchedulerOutput, fed_tokens: torch.Tensor | None = None,
                between: Callable[[], object] | None = None) -> torch.Tensor | None:
        """Run the step; ``fed_tokens``: the previous step's sampled tokens on the device, when
        this step's inputs include some not read back yet (async scheduling); ``between``:
        called while a long launch goes on (the express lane's look for arrivals)."""
        ...

    def express_lane(self) -> contextlib.AbstractContextManager:
        """Launch the body's work on the express lane (``ModelRunner.express_lane``); one GPU only."""
        ...

    def execute_express(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Run an express-lane step (inside ``express_lane()``): the lane's own graphs, beside the step in flight."""
        ...

    def marker(self) -> Any:
        """Something whose ``query()`` says whether the device has finished what was launched
        before it (a CUDA event), or None where launching ran it (the CPU)."""
        ...

    def check(self) -> None:
        """Raise if the step whose results were just read back may be garbage (a rank failed)."""
        ...

    def resize_swap_pool(self, num_blocks: int) -> int: ...

    @property
    def forward_path(self) -> str | None:
        """How the last step's forward ran on rank 0 (``ModelRunner.last_forward``)."""
        ...

    @property
    def logit_stats(self) -> Any:
        """The last step's ``LogitStats`` when its forward computed them (a decode graph), else None."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """Tensor parallel size 1: the model runner lives in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.num_gpu_blocks = self.runner.num_gpu_blocks
        self.num_cpu_blocks = self.runner.num_cpu_blocks

    def execute(self, out: SchedulerOutput, fed_tokens: torch.Tensor | None = None,
                between: Callable[[], object] | None = None) -> torch.Tensor | None:
        return self.runner.execute(self.runner.prepare(out), fed_tokens, between=between)

    def express_lane(self) -> contextlib.AbstractContextManager:
        return self.runner.express_lane()

    def execute_express(self, out: SchedulerOutput) -> torch.Tensor | None:
        return self.runner.execute(self.runner.prepare(out), None, express=True)

    def marker(self) -> torch.cuda.Event | None:
        if self.runner.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def check(self) -> None:
        pass

    @property
    def forward_path(self) -> str | None:
        return self.runner.last_forward

    @property
    def logit_stats(self) -> Any:
        return self.runner.last_logit_stats

    def resize_swap_pool(self, num_blocks: int) -> int:
        self.num_cpu_blocks = self.runner.resize_swap_pool(num_blocks)
        return self.num_cpu_blocks

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel.tensor_parallel_size == 1:
        return LocalExecutor(config)
    from engine.executor.parallel import MultiprocExecutor

    return MultiprocExecutor(config)
