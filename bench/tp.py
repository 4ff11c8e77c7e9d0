"""``sluiceway bench tp``: the throughput workload at several tensor-parallel sizes, and a big model.

Each configuration is one ``python -m bench throughput`` run in a process of its
own, so every run starts on empty GPUs (a finished engine's CUDA graphs and allocator
cache would otherwise shrink the next one's KV cache); their results are gathered into
one report with each size's output tok/s against the first size's (the scaling ratio).

    sluiceway bench tp --json tp.json           # llama3-8b at TP=1 and TP=2, then llama3-70b at TP=2
    python -m bench.tp --tp 1,2,4 --big-model none
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from bench.common import emit, environment
from engine.config import ALL_REDUCES


@click.command("tp")
@click.option("--model", default="llama3-8b", show_default=True, help="Preset run at every size of --tp.")
@click.option("--tp", "tp_sizes", default="1,2", show_default=True,
              help="Tensor-parallel sizes, comma-separated; 'none' runs only the big model.")
@click.option("--big-model", default="llama3-70b", show_default=True, help="A model too large for one GPU; 'none' skips it.")
@click.option("--big-tp", type=int, default=2, show_default=True)
@click.option("--num-requests", "-n", type=int, default=1024, show_default=True)
@click.option("--big-num-requests", type=int, default=None, help="Requests of the big model's run (default: --num-requests).")
@click.option("--input-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--max-num-seqs", type=int, default=None, help="Default: the throughput workload's.")
@click.option("--gpu-memory-utilization", type=float, default=None)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--async-scheduling/--no-async-scheduling", default=None,
              help="Launch each step before the previous one's tokens are read back [default: on].")
@click.option("--all-reduce", type=click.Choice(ALL_REDUCES), default="nccl", show_default=True,
              help="symmetric: all-reduces up to 32 MiB over symmetric memory.")
@click.option("--roofline/--no-roofline", default=None,
              help="Each run's roofline bound (ceilings of one GPU times its TP size) and the fraction "
                   "reached [default: on where CUDA is].")
@click.option("--timeout", "timeout_s", type=int, default=1200, show_default=True, help="Seconds per run.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the result as JSON here ('-' for stdout).")
def tp_command(**opts: Any) -> None:
    """Throughput at each TP size (scaling ratio against the first), then the big model."""
    try:
        sizes = [] if opts["tp_sizes"] == "none" else [int(s) for s in opts["tp_sizes"].split(",")]
    except ValueError:
        sizes = [0]
    if any(s < 1 for s in sizes) or (not sizes and opts["big_model"] == "none"):
        raise click.BadParameter(f"--tp must list positive sizes (or be 'none' with a --big-model), "
                                 f"got {opts['tp_sizes']!r}")
    if opts["roofline"] is None:
        import torch

        opts["roofline"] = torch.cuda.is_available()
    runs = [_throughput(opts, opts["model"], tp, opts["num_requests"]) for tp in sizes]
    base = runs[0] if runs else None
    for run in runs:
        run["scaling_ratio"] = _ratio(run, base)
        run["scaling_efficiency"] = run["scaling_ratio"] / (run["tp"] / base["tp"]) if run["scaling_ratio"] else None
    result: dict[str, Any] = dict(workload="tp", env=environment(), runs=runs)
    if opts["big_model"] != "none":
        result["big"] = _throughput(opts, opts["big_model"], opts["big_tp"],
                                    opts["big_num_requests"] or opts["num_requests"])
    lines = [f"tp  {opts['dtype']}  {opts['num_requests']} requests x {opts['input_len']} in / "
             f"{opts['output_len']} out"]
    for run in runs:
        lines.append(f"  {run['model']} TP={run['tp']}: {_describe(run)}"
                     + (f"  -> {run['scaling_ratio']:.2f}x TP={base['tp']} "
                        f"({100 * run['scaling_efficiency']:.0f}% of linear)" if run is not base and run["scaling_ratio"]
                        else ""))
    if "big" in result:
        big = result["big"]
        lines.append(f"  {big['model']} TP={big['tp']} ({big['num_requests']} requests): {_describe(big)}")
    emit(result, lines, opts["json_path"])
    if any("error" in r for r in [*runs, result.get("big", {})]):
        sys.exit(1)


def _throughput(opts: dict[str, Any], model: str, tp: int, num_requests: int) -> dict[str, Any]:
    """One ``bench throughput`` run in a fresh process; its JSON result, or the error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench", "throughput", "--model", model, "--tensor-parallel-size", str(tp),
               "--num-requests", str(num_requests), "--input-len", str(opts["input_len"]),
               "--output-len", str(opts["output_len"]), "--dtype", opts["dtype"], "--json", str(out)]
        if opts["max_num_seqs"] is not None:
            cmd += ["--max-num-seqs", str(opts["max_num_seqs"])]
        if opts["gpu_memory_utilization"] is not None:
            cmd += ["--gpu-memory-utilization", str(opts["gpu_memory_utilization"])]
        if opts["enforce_eager"]:
            cmd.append("--enforce-eager")
        if opts["roofline"]:
            cmd.append("--roofline")
        cmd += ["--all-reduce", opts["all_reduce"]]
        if opts["async_scheduling"] is not None:
            cmd.append("--async-scheduling" if opts["async_scheduling"] else "--no-async-scheduling")
        click.echo(f"# {' '.join(cmd[1:])}", err=True)
        run: dict[str, Any] = dict(model=model, tp=tp, num_requests=num_requests, command=" ".join(cmd[1:]))
        try:
            proc = subprocess.run(cmd, timeout=opts["timeout_s"])
        except subprocess.TimeoutExpired:
            return dict(run, error=f"timed out after {opts['timeout_s']} s")
        if proc.returncode != 0 or not out.is_file():
            return dict(run, error=f"exited with code {proc.returncode}")
        return dict(run, **json.loads(out.read_text()))


def _ratio(run: dict[str, Any], base: dict[str, Any]) -> float | None:
    if "engine" not in run or "engine" not in base:
        return None
    return run["engine"]["output_tok_s"] / base["engine"]["output_tok_s"]


def _describe(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"FAILED ({run['error']})"
    eng = run["engine"]
    roof = run.get("roofline")
    return (f"{eng['output_tok_s']:.0f} output tok/s, {eng['total_tok_s']:.0f} total tok/s "
            f"({eng['elapsed_s']:.1f} s, startup {run['engine_startup_s']:.1f} s, {run['num_gpu_blocks']} KV blocks)"
            + (f", {100 * roof['fraction']:.0f}% of the roofline ({roof['bound_s']:.1f} s over {roof['gpus']} GPUs)"
               if roof else ""))


if __name__ == "__main__":
    tp_command()
