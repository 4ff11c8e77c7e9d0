"""``sluiceway bench``: the engine on dummy weights of a real architecture, with numbers to compare.

Workloads are subcommands: ``throughput`` lives here; the others (``latency`` among them)
register a click command in ``WORKLOADS`` (``name -> (module, attribute)``), loaded when run,
and reuse the pieces below: ``engine_options`` (the engine's flags), ``build_llm``,
``roofline_result``, ``environment`` and ``emit`` (summary lines, ``--json PATH``), with
``engine.bench_run``'s ``make_workload`` and ``run_requests`` (a timed run with per-step
statistics and optional profiler windows).

    sluiceway bench throughput --model llama3-8b --peer hf --roofline --json out.json
    python -m engine.bench latency --input-len 128 --output-len 256
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from engine.bench_run import Workload, make_workload, parse_windows, run_requests
from engine.config import ALL_REDUCES, KV_CACHE_DTYPES, QUANTIZATIONS

logger = logging.getLogger(__name__)

# Workloads in other modules: name -> (module, attribute of a click command).
WORKLOADS: dict[str, tuple[str, str]] = {
    "latency": ("engine.bench_latency", "latency_command"),
    "worker": ("worker.bench", "bench_command"),
    "tp": ("engine.bench_tp", "tp_command"),
    "swap": ("engine.bench_swap", "swap_command"),
}


class _WorkloadGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *WORKLOADS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in WORKLOADS:
            return super().get_command(ctx, name)
        module, attribute = WORKLOADS[name]
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise click.ClickException(f"bench workload {name!r} ({module}:{attribute}) is unavailable: {err}")


@click.group("bench", cls=_WorkloadGroup)
def bench_command() -> None:
    """Benchmark the engine on dummy weights of a named architecture (see engine.presets)."""
    logging.basicConfig(level=os.environ.get("SLUICEWAY_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ----- shared pieces -------------------------------------------------------------------
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
        click.option("--async-scheduling/--no-async-scheduling", default=None,
                     help="Launch each step before the previous one's tokens are read back [default: on]."),
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
               "tensor_parallel_size", "all_reduce", "seed")


def build_llm(opts: dict[str, Any], workload: Workload):
    """``(LLM, startup seconds)`` for the engine flags in ``opts``."""
    from engine import LLM

    kwargs = {k: opts[k] for k in ENGINE_KEYS if opts.get(k) is not None}
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
        command=" ".join(["python -m engine.bench" if sys.argv[0].endswith(os.path.join("engine", "bench.py"))
                          else "sluiceway bench", *sys.argv[1:]]),
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


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
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


def roofline_result(llm, workload: Workload, ceilings, max_batch: int) -> dict[str, Any]:
    from engine.roofline import ModelCounts, ceilings_dict, generation_bound

    info = llm.llm_engine.info
    gpus = info.tensor_parallel_size
    fp8 = info.quantization == "fp8"
    counts = ModelCounts.from_config(info.hf_config, dtype_bytes=info.dtype.itemsize,
                                     kv_dtype_bytes=info.kv_dtype.itemsize, tensor_parallel_size=gpus,
                                     linear_dtype_bytes=1 if fp8 else None)
    # NOTE: an FP8 model's bound takes every FLOP at the measured float8 rate (a lower bound)
    rated = ceilings.for_fp8() if fp8 and ceilings.fp8_matmul_tflops is not None else ceilings
    # the batch the KV cache can hold at the workload's longest sequence
    longest = max(i + o for i, o in zip(workload.input_lens, workload.output_lens))
    capacity = llm.llm_engine.block_manager.gpu.num_blocks * info.block_size // max(1, longest)
    batch = max(1, min(max_batch, capacity))
    # NOTE: the ceilings were measured on one GPU; TP=N is bounded by N of them together
    bound = generation_bound(counts, rated.over(gpus), workload.input_lens, workload.output_lens, batch,
                             info.max_num_batched_tokens)
    return dict(**ceilings_dict(ceilings), gpus=gpus, weight_bytes=counts.weight_bytes,
                kv_bytes_per_token=counts.kv_bytes_per_token, **bound)


# ----- throughput ----------------------------------------------------------------------
@bench_command.command("throughput")
@engine_options
@click.option("--num-requests", "-n", type=int, default=1024, show_default=True)
@click.option("--input-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--range-ratio", type=float, default=0.0, show_default=True,
              help="Lengths uniform in len*(1-r)..len*(1+r), seeded; 0 = fixed.")
@click.option("--peer", type=click.Choice(["none", "hf"]), default="none", show_default=True,
              help="Also run HF transformers on the same workload, in this process, before the engine.")
@click.option("--hf-modes", default="generate,generate_batch", show_default=True,
              help="HF modes to probe (generate, static, generate_batch); the fastest runs the subset.")
@click.option("--hf-probe-requests", type=int, default=32, show_default=True)
@click.option("--hf-batch-sizes", default="256,512,768,1024", show_default=True,
              help="HF runs one batch of this many requests at each size; its fastest counts.")
@click.option("--hf-probe-output-len", type=int, default=16, show_default=True)
@click.option("--roofline", is_flag=True, help="Measure the GPU's matmul rate and bandwidth; report the bound.")
@click.option("--profile-dir", type=click.Path(file_okay=False), default=None)
@click.option("--profile-steps", default=None, help="Step ranges to profile, e.g. 30:33,200:205.")
@click.option("--warmup/--no-warmup", default=True, show_default=True)
def throughput(**opts: Any) -> None:
    """N requests at once; output and total tokens per second."""
    import torch

    from engine.model_loader import load_hf_config

    hf_batch_sizes = _int_list("--hf-batch-sizes", opts["hf_batch_sizes"])
    hf_config = load_hf_config(opts["model"])
    workload = make_workload(opts["num_requests"], opts["input_len"], opts["output_len"], hf_config.vocab_size,
                             opts["range_ratio"], opts["seed"])
    result: dict[str, Any] = dict(workload="throughput", env=environment(), workload_shape=workload.describe(),
                                  engine_args={k: opts[k] for k in ENGINE_KEYS})
    ceilings = None
    if opts["roofline"]:
        from engine.roofline import measure_ceilings

        ceilings = measure_ceilings(fp8=torch.cuda.get_device_capability() >= (8, 9))
    if opts["peer"] == "hf":
        from engine.bench_hf import run_peer

        try:
            result["peer"] = run_peer(hf_config, getattr(torch, opts["dtype"]), workload.prompts,
                                      workload.output_lens, opts["hf_modes"].split(","),
                                      hf_batch_sizes,
                                      opts["hf_probe_output_len"], opts["hf_probe_requests"])
        except Exception as err:  # noqa: BLE001 - the engine's numbers still count
            logger.exception("the HF peer failed")
            result["peer"] = dict(name="hf", error=f"{type(err).__name__}: {err}"[:500])
    llm, startup_s = build_llm(opts, workload)
    result["engine_startup_s"] = startup_s
    result["max_model_len"] = llm.llm_engine.max_model_len
    result["num_gpu_blocks"] = llm.llm_engine.block_manager.gpu.num_blocks
    if opts["warmup"]:
        _warm_up(llm, workload, opts["max_num_seqs"])
    run = run_requests(llm, workload, opts["profile_dir"], parse_windows(opts["profile_steps"]))
    run.pop("step_times")
    result["engine"] = run
    lines = [
        f"throughput  {opts['model']} {opts['dtype']}{' ' + opts['quantization'] if opts['quantization'] else ''}"
        f"{' kv ' + opts['kv_cache_dtype'] if opts['kv_cache_dtype'] != 'auto' else ''}  {len(workload.prompts)} requests x "
        f"{opts['input_len']} in / {opts['output_len']} out  (max_num_seqs {opts['max_num_seqs']})",
        f"  engine: {run['elapsed_s']:.2f} s  {run['output_tok_s']:.0f} output tok/s  "
        f"{run['total_tok_s']:.0f} total tok/s  (startup {startup_s:.1f} s)",
    ]
    if run["kernels_compiled_in_run"]:
        lines.append(f"  warning: {run['kernels_compiled_in_run']} Triton kernels were compiled inside the timed run "
                     f"(slowest steps, ms/seqs/tokens: {run['steps']['slowest_steps']})")
    peer = result.get("peer")
    if peer and "output_tok_s" in peer:
        result["ratio_vs_peer"] = run["output_tok_s"] / peer["output_tok_s"]
        tried = ", ".join(f"{r['batch_size']}: " + (f"{r['output_tok_s']:.0f}" if "error" not in r else "failed")
                          for r in peer.get("batch_runs", []))
        lines.append(f"  hf ({peer['best_mode']}; output tok/s by batch {tried}): best {peer['output_tok_s']:.0f} "
                     f"at batch {peer['batch_size']} -> engine is {result['ratio_vs_peer']:.2f}x")
    if ceilings is not None:
        roof = roofline_result(llm, workload, ceilings, opts["max_num_seqs"])
        roof["fraction"] = roof["bound_s"] / run["elapsed_s"]
        roof["strict_fraction"] = roof["strict_bound_s"] / run["elapsed_s"]
        roof["serial_fraction"] = roof["serial_bound_s"] / run["elapsed_s"]
        result["roofline"] = roof
        per_gpu = f" per GPU, x{roof['gpus']}" if roof["gpus"] > 1 else ""
        fp8_rate = f" (fp8 {roof['fp8_matmul_tflops']:.0f})" if roof.get("fp8_matmul_tflops") else ""
        lines.append(f"  roofline: {roof['matmul_tflops']:.0f}{fp8_rate} TFLOP/s, {roof['bandwidth_gbs']:.0f} GB/s measured{per_gpu}; "
                     f"bound {roof['bound_s']:.2f} s at batch {roof['max_batch']} -> {100 * roof['fraction']:.0f}% "
                     f"(strict bound {roof['strict_bound_s']:.2f} s -> {100 * roof['strict_fraction']:.0f}%; "
                     f"kernels one after another {roof['serial_bound_s']:.2f} s -> {100 * roof['serial_fraction']:.0f}%)")
    llm.shutdown()
    emit(result, lines, opts["json_path"])


def _int_list(flag: str, text: str) -> list[int]:
    """``"256,512"`` -> [256, 512]; anything else is a usage error naming the flag."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise click.BadParameter(f"{flag} takes positive integers separated by commas, got {text!r}")
    return values


def _warm_up(llm, workload: Workload, max_num_seqs: int) -> None:
    """Compile every kernel variant the run will meet (prefill tiles, decode splits, eager decode
    past the largest graph) on a small workload outside the timing."""
    vocab = llm.llm_engine.vocab_size
    long_len = max(workload.input_lens)
    long_out = max(workload.output_lens)
    # NOTE: within the run's own lengths, which set max_model_len
    small = make_workload(min(len(workload.prompts), max_num_seqs), min(8, long_len), min(3, long_out), vocab, seed=1)
    full = make_workload(4, long_len, min(2, long_out), vocab, seed=2)
    run_requests(llm, Workload(full.prompts + small.prompts, full.output_lens + small.output_lens))


if __name__ == "__main__":
    bench_command()
