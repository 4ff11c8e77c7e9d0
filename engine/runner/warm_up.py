"""Compile, before serving, the kernel variants a mixed step can ask for.

Triton compiles a kernel variant the first time its tile sizes are asked for. The prompt-step
and decode graphs compile theirs at capture, but a step of decodes beside a prompt chunk runs
attention eagerly, and its tiles follow the step: the prefill kernel's rows follow the longest
query (``prefill_config``), a few decodes take the fused rotary kernel and many the split one.
A rare shape then compiled mid-run: a 1.33 s step on an H100 under the mixed-traffic bench
(docs/BENCHMARKS.md, session 24), a 7-token prompt chunk beside 28 decodes. Here each such shape
runs once at start-up over blocks no request holds yet (their contents are garbage and so are
the outputs, which nobody reads).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence
from engine.runner.attention.triton_backend import FUSED_DECODE_MAX_BATCH
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

QUERY_LENS = (2, 4, 8, 16, 32, 64, 128)  # every tile size prefill_config picks, for any head group
SHORT_CONTEXT = 16  # a decode of a short context: one split; a long one splits


def mixed_step_shapes(max_model_len: int, max_tokens: int, num_blocks: int, block_size: int,
                      ) -> list[tuple[int, int, int]]:
    """(decodes, their context, prompt tokens) of the warm-up steps that fit these limits."""
    long_context = min(max_model_len - 1, 4096, num_blocks * block_size - 1)
    shapes = []
    for decodes in (1, FUSED_DECODE_MAX_BATCH + 1):  # the fused decode kernel, then the split one
        for context in sorted({min(SHORT_CONTEXT, long_context), long_context}):
            for query in QUERY_LENS:
                if context >= 1 and query <= min(max_model_len, num_blocks * block_size) and decodes + query <= max_tokens:
                    shapes.append((decodes, context, query))
    return shapes


@torch.inference_mode()
def compile_mixed_steps(runner: "ModelRunner") -> int:
    """Run one step of each ``mixed_step_shapes`` through ``runner`` (graphs where it has them);
    returns how many ran. Only before the runner serves: the steps write into the cache."""
    config = runner.config
    bs = runner.block_size
    shapes = mixed_step_shapes(config.model.max_model_len, config.scheduler.max_num_batched_tokens,
                               runner.num_gpu_blocks, bs)
    params = SamplingParams(max_tokens=1)
    started = time.perf_counter()
    for decodes, context, query in shapes:
        # NOTE: every sequence of the step shares the first blocks: nothing reads them after
        table = list(range(-(-max(context + 1, query) // bs)))
        items = []
        for i in range(decodes):
            seq = Sequence(f"warm-up-{i}", 0, [1] * (context + 1), context + 1, params)
            seq.block_table, seq.num_computed_tokens = table, context
            items.append(ScheduledSeq.of(seq, 1))
        prompt = Sequence("warm-up-prompt", 0, [1] * query, query, params)
        prompt.block_table = table[: -(-query // bs)]
        items.append(ScheduledSeq.of(prompt, query))
        runner.execute(runner.prepare(SchedulerOutput(scheduled=items)))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("warm-up: %d mixed steps (decodes beside a prompt chunk) in %.1f s", len(shapes),
                time.perf_counter() - started)
    return len(shapes)
