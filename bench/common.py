"""What the bench workloads share: the engine's flags (``engine_options``), building the
``LLM`` (``build_llm``), the environment a number needs beside it, the roofline result, and
the output (``emit``: summary lines, ``--json PATH``).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bench.run import Workload
from engine.config import ALL_REDUCES, KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES


def engine_options(f: Callable) -> Callable:
    """The engine's flags, as ``LLM`` takes them (defaults: the benchmark's, not the engine's)."""
    options = [
        click.option("--model", default="llama3-8b", show_default=True, help="Preset architecture (dummy weights)."),
        click.option("--dtype", default="bfloat16", show_default=True),
        # NOTE: with async scheduling 512 beat 384 and 256 in every paired run of the throughput
        # workload on an H200 (docs/BENCHMARKS.md); latency caps it at its batch size.
        click.option("--max-num-seqs", type=int, default=512, show_default=True),
        click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True),
        click.option("--max-model-len", type=int, default=None, help="Default: longest input + longest output."),
        click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
                     show_default=True, help="fp8: keys and values stored as float8 e4m3."),
        click.option("--quantization", "-q", type=click.Choice(QUANTIZATIONS), default=None,
                     help="fp8: W8A8, float8 weights (one scale per output channel) and per-token activations."),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs."),
        click.option("--small-batch-kernels/--no-small-batch-kernels", default=None,
                     help="Steps of up to 8 tokens: five kernels a layer, norms and SwiGLU folded in [default: off]."),
        click.option("--prefill-graph-tokens", type=int, default=None,
                     help="Prompt-carrying steps of up to this many tokens replay CUDA graphs; 0: eager [default: 512 on one GPU]."),
        click.option("--async-scheduling/--no-async-scheduling", default=None,
                     help="Launch each step before the previous one's tokens are read back [default: on]."),
        click.option("--scheduling-policy", type=click.Choice(SCHEDULING_POLICIES), default=None,
                     help="priority: higher priority first, preempting lower ranks; fcfs: arrival order [default: priority]."),
        click.option("--tensor-parallel-size", "-tp", type=int, default=1, show_default=True),
        click.option("--all-reduce", type=click.Choice(ALL_REDUCES), default="nccl", show_default=True,
                     help="TP: symmetric = all-reduces up to 32 MiB over symmetric memory."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                     help="Write the result as JSON here ('-' for stdout)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


ENGINE_KEYS = ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "gpu_memory_utilization", "block_size", "kv_cache_dtype", "quantization", "enforce_eager", "async_scheduling",
               "prefill_graph_tokens", "small_batch_kernels", "scheduling_policy", "tensor_parallel_size", "all_reduce", "seed")


def build_llm(opts: dict[str, Any], workload: Workload):
    """``(LLM, startup seconds)`` for the engine flags in ``opts``."""
    from engine import LLM

    kwargs = {k: opts[k] for k in ENGINE_KEYS if opts.get(k) is not None}
    if opts.get("tokenizer"):  # a structured-output run's (bench/structured.py)
        kwargs["tokenizer"] = opts["tokenizer"]
    kwargs.setdefault("max_model_len", max(workload.input_lens) + max(workload.output_lens))
    start = time.perf_counter()
    llm = LLM(load_format="dummy", **kwargs)
    return llm, time.perf_counter() - start


def environment() -> dict[str, Any]:
    """GPU, driver and library versions, date and commit: what a number needs beside it."""
    import torch

    env: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
        command=command_line(),
        commit=os.environ.get("SLUICEWAY_COMMIT") or _git_commit(),
    )
    for name in ("triton", "transformers"):
        try:
            env[name] = importlib.import_module(name).__version__
        except ImportError:
            env[name] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = None
    return env


def command_line() -> str:
    """This process's command as a user types it: ``python -m bench ...``, ``sluiceway bench ...``."""
    program = sys.argv[0]
    for package in ("bench", "sluiceway"):
        if program.endswith(os.path.join(package, "__main__.py")):
            return " ".join([f"python -m {package}", *sys.argv[1:]])
    return " ".join([os.path.basename(program), *sys.argv[1:]])


def _git_commit() -> str | None:
    try:
        # NOTE: "-dirty" when the tree is not the commit's: a device's copy of the working tree
        # can carry older git metadata than the files it runs (pass SLUICEWAY_COMMIT there)
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def emit(result: dict[str, Any], lines: list[str], json_path: str | None) -> None:
    """Print the summary lines; write the whole result as JSON when asked."""
    for line in lines:
        click.echo(line)
    if json_path == "-":
        click.echo(json.dumps(result, indent=2, default=str))
    elif json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))


def print_report(report: dict[str, Any], json_path: str | None) -> None:
    """Print the whole report as JSON; also write it to ``json_path`` when given."""
    text = json.dumps(report, indent=2)
    click.echo(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def roofline_result(llm, workload: Workload, ceilings, max_batch: int) -> dict[str, Any]:
    from bench.roofline import ModelCounts, ceilings_dict, generation_bound

    config = llm.llm_engine.config
    gpus = config.parallel.tensor_parallel_size
    fp8 = config.model.quantization == "fp8"
    counts = ModelCounts.from_config(config.model.hf_config, dtype_bytes=config.model.dtype.itemsize,
                                     kv_dtype_bytes=config.kv_dtype.itemsize, tensor_parallel_size=gpus,
                                     linear_dtype_bytes=1 if fp8 else None)
    # NOTE: an FP8 model's bound takes every FLOP at the measured float8 rate (a lower bound)
    rated = ceilings.for_fp8() if fp8 and ceilings.fp8_matmul_tflops is not None else ceilings
    # the batch the KV cache can hold at the workload's longest sequence
    longest = max(i + o for i, o in zip(workload.input_lens, workload.output_lens))
    capacity = llm.llm_engine.block_manager.gpu.num_blocks * config.cache.block_size // max(1, longest)
    batch = max(1, min(max_batch, capacity))
    # NOTE: the ceilings were measured on one GPU; TP=N is bounded by N of them together
    bound = generation_bound(counts, rated.over(gpus), workload.input_lens, workload.output_lens, batch,
                             config.scheduler.max_num_batched_tokens)
    return dict(**ceilings_dict(ceilings), gpus=gpus, weight_bytes=counts.weight_bytes,
                kv_bytes_per_token=counts.kv_bytes_per_token, **bound)
