"""``sluiceway bench swap``: swap bandwidth, and swap vs recompute vs room for everything.

One command measures, on one GPU:

- the swap copies themselves: GB/s of ``CacheEngine.swap_out`` / ``swap_in`` batches of
  many blocks, with host blocks in runs (a fresh pool) and scattered (a churned one), the
  naive one-indexed-copy-per-direction for comparison, and how much of a swap-out the
  forward hides (a matmul loop alone, the swap alone, both at once);
- the workload: ``--num-requests`` x ``--input-len`` in / ``--output-len`` out with the KV
  cache limited to ``--kv-fraction`` of what every request at full length needs, once with
  ``preemption_mode=swap``, once with ``recompute``, and once with no limit; each run says
  where swap time went (host time in the swap calls, side-stream copy time, what the
  forward waited for, chunks pinned ahead vs inside a step) and the tokens recomputed.

The copies are measured first, in this process, which then frees what they used; each
workload run is a fresh process (``run-one``), so every engine starts on an empty GPU. The
JSON file is rewritten after each part, so a run cut short still leaves the others.

    sluiceway bench swap --json swap.json
    python -m bench.swap swap --num-requests 64 --modes swap,recompute
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench.common import emit, environment
from bench.run import make_workload, run_requests

MODES = ("swap", "recompute", "unconstrained")


@click.command("swap")
@click.option("--model", default="llama3-8b", show_default=True, help="Preset architecture (dummy weights).")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--num-requests", "-n", type=int, default=256, show_default=True)
@click.option("--input-len", type=int, default=2048, show_default=True)
@click.option("--output-len", type=int, default=512, show_default=True)
@click.option("--kv-fraction", type=float, default=0.25, show_default=True,
              help="GPU KV blocks as a fraction of the workload's demand (every request at full length).")
@click.option("--swap-space", type=float, default=32.0, show_default=True,
              help="GiB of swap pool per GPU (host memory is taken only as chunks are used).")
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--modes", default=",".join(MODES), show_default=True, help="Workload runs, comma-separated.")
@click.option("--copy-blocks", type=int, default=512, show_default=True, help="Blocks per measured swap batch.")
@click.option("--timeout", "timeout_s", type=int, default=300, show_default=True, help="Seconds per workload run.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the result as JSON here ('-' for stdout).")
def swap_command(**opts: Any) -> None:
    """Swap GB/s both ways; the long-prompt workload under a quarter of its KV: swap, recompute, unconstrained."""
    modes = [m.strip() for m in opts["modes"].split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise click.BadParameter(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    result: dict[str, Any] = dict(workload="swap", env=environment(), options=dict(opts), runs={})
    result["copies"] = measure_copies(opts["model"], opts["dtype"], opts["block_size"], opts["copy_blocks"])
    _save(result, opts["json_path"])
    for mode in modes:
        result["runs"][mode] = _run_in_subprocess(mode, opts)
        _save(result, opts["json_path"])  # what is done survives a run that is cut short
    runs = result["runs"]
    for a, b in (("swap", "recompute"), ("swap", "unconstrained"), ("recompute", "unconstrained")):
        if "engine" in runs.get(a, {}) and "engine" in runs.get(b, {}):
            result[f"{a}_vs_{b}"] = runs[a]["engine"]["output_tok_s"] / runs[b]["engine"]["output_tok_s"]
    emit(result, _lines(opts, result), opts["json_path"])
    if any("error" in run for run in runs.values()):
        sys.exit(1)


@click.command("run-one")
@click.option("--mode", type=click.Choice(MODES), required=True)
@click.option("--options", "options_json", required=True, help="The swap command's options as JSON.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), required=True)
def run_one_command(mode: str, options_json: str, json_path: str) -> None:
    """One workload run (a process of its own; ``swap`` starts these)."""
    result = run_workload(mode, json.loads(options_json))
    Path(json_path).write_text(json.dumps(result, indent=2, default=str))


# ----- the workload -----------------------------------------------------------------------
def run_workload(mode: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Build the engine for ``mode``, warm it up, run the workload, report its swap statistics."""
    from engine import LLM
    from engine.models.loader import load_hf_config

    vocab = load_hf_config(opts["model"]).vocab_size
    workload = make_workload(opts["num_requests"], opts["input_len"], opts["output_len"], vocab, seed=opts["seed"])
    bs = opts["block_size"]
    demand = sum(math.ceil((i + o) / bs) for i, o in zip(workload.input_lens, workload.output_lens))
    kwargs: dict[str, Any] = dict(
        model=opts["model"], load_format="dummy", dtype=opts["dtype"], max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"], block_size=bs, enforce_eager=opts["enforce_eager"],
        seed=opts["seed"], max_model_len=max(workload.input_lens) + max(workload.output_lens),
        swap_space=opts["swap_space"] if mode == "swap" else 0,
    )
    if mode != "unconstrained":
        longest = math.ceil((max(workload.input_lens) + max(workload.output_lens)) / bs)
        kwargs.update(num_gpu_blocks_override=max(longest, math.ceil(demand * opts["kv_fraction"])),
                      preemption_mode=mode)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - start
    engine = llm.llm_engine
    warm = make_workload(min(8, opts["num_requests"]), opts["input_len"], 4, vocab, seed=opts["seed"] + 1)
    run_requests(llm, warm)
    cache = getattr(getattr(engine.executor, "runner", None), "cache", None)
    counters_before = _counters(cache)
    before = engine.get_stats()
    run = run_requests(llm, workload)
    run.pop("step_times")
    after = engine.get_stats()
    per_block = engine.config.kv_bytes_per_block * engine.config.parallel.tensor_parallel_size
    stats = {k: getattr(after, k) - getattr(before, k) for k in (
        "num_preemptions", "num_swap_outs", "num_swap_ins", "num_recomputes", "num_swapped_out_blocks",
        "num_swapped_in_blocks", "swap_out_bytes", "swap_in_bytes", "num_prompt_tokens")}
    stats["recomputed_prompt_tokens"] = stats["num_prompt_tokens"] - run["input_tokens"]
    stats["swap_pool_resident_bytes"] = after.swap_pool_resident_bytes
    stats["num_rank_preemptions"] = after.num_rank_preemptions - before.num_rank_preemptions
    if cache is not None:
        cache.synchronize()
        stats["time"] = _where_time_went(counters_before, _counters(cache), run["elapsed_s"])
        stats["copy_calls"] = stats["time"].pop("copies")
    llm.shutdown()
    return dict(mode=mode, engine_args={k: v for k, v in kwargs.items() if k != "load_format"},
                startup_s=startup_s, kv_demand_blocks=demand, num_gpu_blocks=after.num_gpu_blocks,
                kv_fraction_actual=after.num_gpu_blocks / demand, block_bytes=per_block, engine=run, stats=stats)


def _counters(cache) -> dict[str, float]:
    return dataclasses.asdict(cache.counters) if cache is not None else {}


def _where_time_went(before: dict[str, float], after: dict[str, float], elapsed_s: float) -> dict[str, Any]:
    """The swap counters of rank 0's cache engine over the timed run (``SwapCounters``).

    ``host_s``: the step loop's time inside the swap calls (issuing copies, pinning chunks that
    were not ready); ``device_*_s``: side-stream time of the copies, which overlaps the
    forward; ``compute_wait_s``: what of it the forward waited for (the gathers of a swap-out,
    the scatters of a swap-in); each also as a fraction of the run.
    """
    diff = {k: after[k] - before.get(k, 0) for k in after}
    for key in ("host_s", "device_out_s", "device_in_s", "compute_wait_s"):
        diff[key.removesuffix("_s") + "_fraction"] = diff[key] / elapsed_s if elapsed_s else 0.0
    return diff


def _save(result: dict[str, Any], json_path: str | None) -> None:
    if json_path and json_path != "-":
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))


def _run_in_subprocess(mode: str, opts: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        options = {k: v for k, v in opts.items() if k != "json_path"}
        cmd = [sys.executable, "-m", "bench.swap", "run-one", "--mode", mode,
               "--options", json.dumps(options), "--json", str(out)]
        click.echo(f"# swap bench: {mode} run", err=True)
        try:
            proc = subprocess.run(cmd, timeout=opts["timeout_s"])
        except subprocess.TimeoutExpired:
            return dict(mode=mode, error=f"timed out after {opts['timeout_s']} s")
        if proc.returncode != 0 or not out.is_file():
            return dict(mode=mode, error=f"exited with code {proc.returncode}")
        return json.loads(out.read_text())


# ----- the copies ------------------------------------------------------------------------
def measure_copies(model: str, dtype: str, block_size: int, num_blocks: int, repeats: int = 5) -> dict[str, Any]:
    """GB/s of batched swap copies of ``num_blocks`` blocks of ``model``'s KV (one rank, TP=1)."""
    import torch

    from engine.runner.cache_engine import CacheEngine
    from engine.models.loader import load_hf_config
    from engine.models.shape import ModelShape
    from engine.core.swap import SWAP_CHUNK_BYTES

    cfg = load_hf_config(model)
    shape = ModelShape.from_hf_config(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype)
    bpb = shape.kv_bytes_per_token(torch_dtype.itemsize) * block_size
    chunk = max(1, SWAP_CHUNK_BYTES // bpb)
    cache = CacheEngine(shape, block_size, 2 * num_blocks, chunk, torch_dtype, device)
    cache.gpu.normal_()
    gen = torch.Generator().manual_seed(0)
    gpu_ids = torch.randperm(2 * num_blocks, generator=gen)[:num_blocks]
    layouts = {
        "runs": torch.arange(num_blocks),  # a fresh pool: consecutive host blocks
        "scattered": torch.randperm(2 * num_blocks, generator=gen)[:num_blocks],  # a churned one
    }

    def sync() -> None:
        cache.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        fn()  # warm-up: allocates the host chunks, compiles nothing
        sync()
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    nbytes = num_blocks * bpb
    result: dict[str, Any] = dict(device=str(device), block_bytes=bpb, blocks=num_blocks,
                                  bytes_per_batch=nbytes, chunk_blocks=chunk)
    for name, cpu_ids in layouts.items():
        out_pairs = torch.stack([gpu_ids, cpu_ids], dim=1)
        in_pairs = torch.stack([cpu_ids, gpu_ids.flip(0)], dim=1)
        copies_before = cache.counters.copies
        out_s = timed(lambda: cache.swap_out(out_pairs))
        calls = (cache.counters.copies - copies_before) // (repeats + 1)
        in_s = timed(lambda: cache.swap_in(in_pairs))
        result[name] = dict(swap_out_gbs=nbytes / out_s / 1e9, swap_in_gbs=nbytes / in_s / 1e9,
                            swap_out_ms=1e3 * out_s, swap_in_ms=1e3 * in_s, copy_calls_per_batch=calls)
    result["naive"] = _naive_copies(cache, gpu_ids, timed, nbytes)
    if device.type == "cuda":
        result["overlap"] = _overlap(cache, torch.stack([gpu_ids, layouts["runs"]], dim=1), sync)
    cache.truncate(0)
    del cache
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the workload runs in other processes: leave them the GPU
    return result


def _naive_copies(cache, gpu_ids, timed, nbytes: int) -> dict[str, Any]:
    """One indexed copy per direction through a (L, 2, N, ...) host tensor (pinned on CUDA), synchronously."""
    import torch

    gpu = cache.gpu
    host = torch.empty(gpu.shape[:2] + (len(gpu_ids),) + gpu.shape[3:], dtype=gpu.dtype,
                       pin_memory=gpu.device.type == "cuda")
    dst = torch.arange(len(gpu_ids))
    src_dev = gpu_ids.to(gpu.device)

    def out() -> None:
        host[:, :, dst] = gpu[:, :, src_dev].to("cpu")

    def back() -> None:
        gpu[:, :, src_dev] = host[:, :, dst].to(gpu.device, non_blocking=True)

    out_s, in_s = timed(out), timed(back)
    return dict(swap_out_gbs=nbytes / out_s / 1e9, swap_in_gbs=nbytes / in_s / 1e9)


def _overlap(cache, pairs, sync, size: int = 8192, matmuls: int = 40) -> dict[str, Any]:
    """A matmul loop alone, a swap-out alone, both issued together: how much of the copy is hidden."""
    import torch

    a = torch.randn(size, size, device=cache.device, dtype=torch.bfloat16)

    def compute() -> None:
        for _ in range(matmuls):
            a @ a

    def both() -> None:
        cache.swap_out(pairs)
        compute()

    times = {}
    for name, fn in (("compute", compute), ("swap_out", lambda: cache.swap_out(pairs)), ("both", both)):
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times[name] = time.perf_counter() - t0
    hidden = (times["compute"] + times["swap_out"] - times["both"]) / min(times["compute"], times["swap_out"])
    return dict(compute_ms=1e3 * times["compute"], swap_out_ms=1e3 * times["swap_out"], both_ms=1e3 * times["both"],
                hidden_fraction=max(0.0, min(1.0, hidden)))


# ----- report ----------------------------------------------------------------------------
def _lines(opts: dict[str, Any], result: dict[str, Any]) -> list[str]:
    lines = [f"swap  {opts['model']} {opts['dtype']}  {opts['num_requests']} requests x {opts['input_len']} in / "
             f"{opts['output_len']} out, KV limited to {opts['kv_fraction']:.2f} of demand"]
    for mode, run in result["runs"].items():
        if "error" in run:
            lines.append(f"  {mode}: FAILED ({run['error']})")
            continue
        eng, st = run["engine"], run["stats"]
        lines.append(
            f"  {mode}: {eng['elapsed_s']:.1f} s  {eng['output_tok_s']:.0f} output tok/s  "
            f"({run['num_gpu_blocks']} KV blocks = {run['kv_fraction_actual']:.2f} of demand; "
            f"{st['num_preemptions']} preemptions: {st['num_swap_outs']} swapped "
            f"({(st['swap_out_bytes'] + st['swap_in_bytes']) / 1e9:.1f} GB moved), {st['num_recomputes']} recomputed "
            f"({st['recomputed_prompt_tokens']} tokens))")
        t = st.get("time")
        if t:
            lines.append(
                f"    swap time: host {t['host_s']:.2f} s ({100 * t['host_fraction']:.1f}%), side stream out "
                f"{t['device_out_s']:.2f} s / in {t['device_in_s']:.2f} s, the forward waited "
                f"{t['compute_wait_s']:.2f} s ({100 * t['compute_wait_fraction']:.1f}%); chunks pinned ahead "
                f"{t['chunks_pinned_ahead']}, inside a step {t['chunks_pinned_in_step']}")
    for key in ("swap_vs_recompute", "swap_vs_unconstrained"):
        if key in result:
            lines.append(f"  {key.replace('_', ' ')}: {result[key]:.2f}x output tok/s")
    c = result["copies"]
    for name in ("runs", "scattered", "naive"):
        r = c[name]
        lines.append(f"  copies ({name}, {c['blocks']} blocks of {c['block_bytes'] / 2**20:.1f} MiB): "
                     f"out {r['swap_out_gbs']:.1f} GB/s, in {r['swap_in_gbs']:.1f} GB/s")
    if "overlap" in c:
        lines.append(f"  a swap-out during compute: {100 * c['overlap']['hidden_fraction']:.0f}% of it hidden")
    return lines


main = click.Group("bench.swap", commands={"swap": swap_command, "run-one": run_one_command})

if __name__ == "__main__":
    main()
