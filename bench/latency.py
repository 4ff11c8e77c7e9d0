"""``sluiceway bench latency``: one batch at a time (batch 1 by default), time to first token
and milliseconds per output token, p50/p90 over several timed runs.

    python -m bench latency --input-len 128 --output-len 256 --roofline
"""

from __future__ import annotations

import statistics
from typing import Any

import click

from bench.common import ENGINE_KEYS, build_llm, emit, engine_options, environment, roofline_result
from bench.run import Workload, make_workload, percentile, run_requests
from bench import structured


def token_intervals(step_times: list[float], step_tokens: list[int]) -> tuple[float, list[float]]:
    """Time to the first token and the gaps between later ones, for one sequence's steps.

    A token counts when the step that hands it back ends: with async scheduling the first
    step only launches the prefill, and each later step returns the token of the one before.
    """
    first, gaps, elapsed = None, [], 0.0
    for seconds, tokens in zip(step_times, step_tokens, strict=True):
        elapsed += seconds
        if tokens:
            if first is None:
                first = elapsed
            else:
                gaps.append(elapsed)
            elapsed = 0.0
    if first is None:
        raise RuntimeError("the run produced no tokens")
    return first, gaps


@click.command("latency")
@engine_options
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--batch-size", type=int, default=1, show_default=True)
@click.option("--num-iters", type=int, default=5, show_default=True)
@click.option("--peer", type=click.Choice(["none", "hf"]), default="none", show_default=True)
@click.option("--hf-output-len", type=int, default=32, show_default=True,
              help="HF generates this many tokens (its batch-1 decode is slow).")
@click.option("--roofline", is_flag=True)
@click.option("--profile-dir", type=click.Path(file_okay=False), default=None,
              help="Profile steps 100:110 of a run after the timed ones; tables go here.")
@structured.structured_options
def latency_command(**opts: Any) -> None:
    """One batch at a time: time to first token and milliseconds per output token (p50/p90)."""
    import torch

    from engine.models.loader import load_hf_config

    opts["max_num_seqs"] = min(opts["max_num_seqs"], max(opts["batch_size"], 1))
    structured.check_opts(opts)
    hf_config = load_hf_config(opts["model"])
    structured.prepare_tokenizer(opts, hf_config)
    result: dict[str, Any] = dict(workload="latency", env=environment(), engine_args={k: opts[k] for k in ENGINE_KEYS},
                                  batch_size=opts["batch_size"], input_len=opts["input_len"],
                                  output_len=opts["output_len"], num_iters=opts["num_iters"])
    ceilings = None
    if opts["roofline"]:
        from bench.roofline import measure_ceilings

        ceilings = measure_ceilings(fp8=torch.cuda.get_device_capability() >= (8, 9))
    batches = [make_workload(opts["batch_size"], opts["input_len"], opts["output_len"], hf_config.vocab_size,
                             seed=opts["seed"] + i) for i in range(opts["num_iters"] + 1)]
    if opts["peer"] == "hf":
        from bench.hf_peer import run_peer

        hf_out = min(opts["hf_output_len"], opts["output_len"])
        result["peer"] = run_peer(hf_config, getattr(torch, opts["dtype"]), batches[0].prompts,
                                  [hf_out] * opts["batch_size"], ["generate"], [opts["batch_size"]], hf_out)
    llm, startup_s = build_llm(opts, batches[0])
    result["engine_startup_s"] = startup_s
    # NOTE: nothing is profiled before the timed runs. Once the profiler has traced CUDA,
    # CUPTI stays attached for the life of the process (torch leaves it so when CUDA graphs
    # are in use) and every later eager launch pays for it: the prefill, which is eager, got
    # slower by about its launch count times that overhead, while graph-replayed decode
    # steps did not. Launches are counted, and --profile-dir profiled, in one run after them.
    run_requests(llm, batches[0])  # warm-up
    if opts["structured"] != "none":
        result["structured_compile_s"] = structured.warm_up(llm, batches[0].output_lens, batches[0].prompts, opts)
        result["structured"] = _structured_latency(llm, batches, opts)
    ttft, itl, e2e = [], [], []
    result["timed_after_profiler"] = False  # a timed run in a process the profiler had traced: slower launches
    for batch in batches[1:]:
        run = run_requests(llm, batch)
        result["timed_after_profiler"] |= run["after_profiler"]
        first, gaps = token_intervals(run["step_times"], run["step_tokens"])
        ttft.append(first)
        itl.extend(gaps)
        e2e.append(run["elapsed_s"])
    windows = []
    if torch.cuda.is_available():
        # the first step() call launches the prompt step alone; later ones decode
        windows += [(0, 1), (40, 50) if opts["output_len"] > 50 else (1, max(2, opts["output_len"]))]
    if opts["profile_dir"] and opts["output_len"] > 110:
        windows.append((100, 110))
    if windows:
        profiled = run_requests(llm, batches[0], opts["profile_dir"], windows)["profiles"]
        if torch.cuda.is_available() and len(profiled) >= 2:
            prompt, counted = profiled[:2]
            result["launches_per_step"] = counted["launches_per_step"]
            result["kernels_per_step"] = counted["kernels_per_step"]
            result["host_launch_calls_per_step"] = counted["host_launch_calls_per_step"]
            result["launch_count_steps"] = counted["steps"]
            result["launch_count_top"] = counted["top_kernels"]
            # each kernel's own share of the step's timeline (a kernel launched early waits inside
            # its span; that wait is the kernel before it's), and the idle gaps: ms over the window
            steps = _window_steps(counted["steps"])
            result["step_time_own_top"] = counted["top_kernels_own"]
            result["gpu_idle_ms_per_step"] = 1e3 * counted["gpu_idle_s"] / steps
            # the host's launch calls for the prompt step: what bounds TTFT when the prefill runs eagerly
            result["prompt_step"] = {k: prompt[k] for k in ("kernels_per_step", "host_launch_calls_per_step",
                                                            "wall_s", "gpu_busy_s")}
        if opts["profile_dir"] and len(profiled) == len(windows):
            result["profiles"] = profiled[-1:]
    ms = [1e3 * t for t in itl]
    result["engine"] = dict(
        ttft_ms_p50=1e3 * percentile(ttft, 50), ttft_ms_p90=1e3 * percentile(ttft, 90),
        itl_ms_p50=percentile(ms, 50), itl_ms_p90=percentile(ms, 90), itl_ms_mean=statistics.fmean(ms),
        output_tok_s_per_seq=1e3 / statistics.fmean(ms), e2e_s_p50=percentile(e2e, 50),
    )
    eng = result["engine"]
    lines = [
        f"latency  {opts['model']} {opts['dtype']}{' ' + opts['quantization'] if opts['quantization'] else ''}  batch {opts['batch_size']}, {opts['input_len']} in / "
        f"{opts['output_len']} out, {opts['num_iters']} iterations",
        f"  engine: TTFT p50 {eng['ttft_ms_p50']:.1f} ms p90 {eng['ttft_ms_p90']:.1f} ms;  per output token "
        f"p50 {eng['itl_ms_p50']:.2f} ms p90 {eng['itl_ms_p90']:.2f} ms  ->  {eng['output_tok_s_per_seq']:.0f} tok/s "
        f"per sequence",
    ]
    if "prompt_step" in result:
        ps = result["prompt_step"]
        lines.append(f"  prompt step: {ps['kernels_per_step']:.0f} kernels from {ps['host_launch_calls_per_step']:.0f} "
                     f"host launch calls, {1e3 * ps['wall_s']:.1f} ms (GPU busy {1e3 * ps['gpu_busy_s']:.1f} ms, profiled)")
    if "launches_per_step" in result:
        lines.append(f"  launches per decode step (one token per sequence): {result['launches_per_step']:.0f} "
                     f"({result['kernels_per_step']:.0f} kernels, the rest copies), steps {result['launch_count_steps']} "
                     "of a run after the timed ones")
        steps = _window_steps(result["launch_count_steps"])
        own = ", ".join(f"{name[:32]} {1e3 * ms / steps:.0f}" for name, ms in result["step_time_own_top"][:6])
        lines.append(f"  a decode step's own time by kernel (us): {own}; idle {1e3 * result['gpu_idle_ms_per_step']:.0f}")
    if "structured" in result:
        st = result["structured"]
        lines.append(f"  structured ({opts['structured_distinct']} grading JSON schema(s), {st['output_tokens']} tokens "
                     f"per iteration, {st['finished_stop']} ended complete): per output token p50 "
                     f"{st['constrained_itl_ms_p50']:.2f} ms vs {st['unconstrained_itl_ms_p50']:.2f} ms unconstrained "
                     f"at the same lengths -> {st['itl_ratio']:.3f}x the time per token")
    peer = result.get("peer")
    if peer and "output_tok_s" in peer:
        per_seq = peer["output_tok_s"] / opts["batch_size"]
        result["ratio_vs_peer"] = eng["output_tok_s_per_seq"] / per_seq
        lines.append(f"  hf generate ({peer['output_tokens'] // opts['batch_size']} tokens incl. prefill): "
                     f"{per_seq:.1f} tok/s per sequence -> engine is {result['ratio_vs_peer']:.1f}x")
    if ceilings is not None:
        roof = roofline_result(llm, batches[1], ceilings, opts["batch_size"])
        per_token = roof["decode_bound_s"] / max(1, roof["decode_steps"])
        roof["decode_ms_per_token_bound"] = 1e3 * per_token
        roof["fraction"] = roof["decode_ms_per_token_bound"] / eng["itl_ms_mean"]
        result["roofline"] = roof
        lines.append(f"  roofline: {roof['bandwidth_gbs']:.0f} GB/s measured -> {1e3 * per_token:.2f} ms per token "
                     f"bound ({1 / per_token:.0f} tok/s); achieved {100 * roof['fraction']:.0f}%")
    llm.shutdown()
    emit(result, lines, opts["json_path"])


def _structured_latency(llm, batches: list[Workload], opts: dict[str, Any]) -> dict[str, Any]:
    """Each timed batch constrained, then unconstrained at the lengths it reached (bench/structured.py)."""
    gaps: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    tokens, finished = 0, 0
    for batch in batches[1:]:
        params = structured.constrained_params(batch.output_lens, opts["structured_distinct"],
                                               opts["structured_string_len"])
        run = run_requests(llm, batch, params=params)
        lengths = run["output_lens"]
        tokens += sum(lengths)
        finished += sum(1 for f in run["finish_reasons"] if f == "stop")
        plain = run_requests(llm, Workload(batch.prompts, lengths), params=structured.matched_params(lengths))
        for name, r in (("constrained", run), ("unconstrained", plain)):
            gaps[name].extend(token_intervals(r["step_times"], r["step_tokens"])[1])
    ms = {name: [1e3 * g for g in values] for name, values in gaps.items()}
    out = {f"{name}_itl_ms_p50": percentile(values, 50) for name, values in ms.items()}
    out.update({f"{name}_itl_ms_mean": statistics.fmean(values) for name, values in ms.items()})
    out.update(output_tokens=tokens // max(1, len(batches) - 1), finished_stop=finished,
               itl_ratio=out["constrained_itl_ms_mean"] / out["unconstrained_itl_ms_mean"])
    return out


def _window_steps(steps: str) -> int:
    """The steps a profile window ``"first:end"`` covers."""
    first, end = (int(n) for n in steps.split(":"))
    return max(1, end - first)
