"""``sluiceway bench throughput``: N requests at once; output and total tokens per second,
HF transformers on the same workload (``--peer hf``), the roofline bound (``--roofline``).

    sluiceway bench throughput --model llama3-8b --peer hf --roofline --json out.json
"""

from __future__ import annotations

import logging
from typing import Any

import click

from bench.common import ENGINE_KEYS, build_llm, emit, engine_options, environment, roofline_result
from bench.run import Workload, make_workload, parse_windows, run_requests
from bench import structured

logger = logging.getLogger(__name__)


@click.command("throughput")
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
@structured.structured_options
def throughput_command(**opts: Any) -> None:
    """N requests at once; output and total tokens per second."""
    import torch

    from engine.models.loader import load_hf_config

    hf_batch_sizes = _int_list("--hf-batch-sizes", opts["hf_batch_sizes"])
    structured.check_opts(opts)
    hf_config = load_hf_config(opts["model"])
    structured.prepare_tokenizer(opts, hf_config)
    workload = make_workload(opts["num_requests"], opts["input_len"], opts["output_len"], hf_config.vocab_size,
                             opts["range_ratio"], opts["seed"])
    result: dict[str, Any] = dict(workload="throughput", env=environment(), workload_shape=workload.describe(),
                                  engine_args={k: opts[k] for k in ENGINE_KEYS})
    ceilings = None
    if opts["roofline"]:
        from bench.roofline import measure_ceilings

        ceilings = measure_ceilings(fp8=torch.cuda.get_device_capability() >= (8, 9))
    if opts["peer"] == "hf":
        from bench.hf_peer import run_peer

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
    if opts["structured"] != "none":
        result["structured_compile_s"] = structured.warm_up(llm, workload.output_lens, workload.prompts, opts)
        paired = structured.paired_runs(llm, workload, lambda w, p: _timed(llm, w, params=p), opts)
        run = result["engine"] = paired.pop("constrained")
        result["structured"] = paired
    else:
        run = result["engine"] = _timed(llm, workload, opts["profile_dir"], parse_windows(opts["profile_steps"]))
    lines = [
        f"throughput  {opts['model']} {opts['dtype']}{' ' + opts['quantization'] if opts['quantization'] else ''}"
        f"{' kv ' + opts['kv_cache_dtype'] if opts['kv_cache_dtype'] != 'auto' else ''}  {len(workload.prompts)} requests x "
        f"{opts['input_len']} in / {opts['output_len']} out  (max_num_seqs {opts['max_num_seqs']})",
        f"  engine: {run['elapsed_s']:.2f} s  {run['output_tok_s']:.0f} output tok/s  "
        f"{run['total_tok_s']:.0f} total tok/s  (startup {startup_s:.1f} s)",
    ]
    if "structured" in result:
        plain, paired = result["structured"]["unconstrained"], result["structured"]
        lines.append(f"  structured: every request constrained by one of {opts['structured_distinct']} grading "
                     f"JSON schema(s) ({paired['constrained_finished_stop']} ended complete, compiled in "
                     f"{result['structured_compile_s']:.1f} s in the warm-up); unconstrained at the same lengths "
                     f"{plain['output_tok_s']:.0f} output tok/s -> ratio {paired['ratio']:.3f}")
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


def _timed(llm, workload: Workload, *args: Any, **kwargs: Any) -> dict[str, Any]:
    run = run_requests(llm, workload, *args, **kwargs)
    run.pop("step_times")
    return run


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

