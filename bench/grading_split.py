"""Where a ``bench grading`` run's time goes: the worker's wall time split into engine steps
(those carrying prompt tokens, decode-only ones) and the time outside them, the same jobs
through the engine alone (``--offline``), and the roofline's prefill and decode bounds beside
the measured steps, so that worker, engine and bound compare in numbers.
"""

from __future__ import annotations

from typing import Any

from bench.run import StepLog


def steps_part(summary: dict[str, Any]) -> dict[str, Any]:
    """A ``StepLog.summary()`` cut to the split: calls, seconds inside them, mixed against decode-only.

    A call that waited for no step (the first with async scheduling, one that only launched)
    counts under ``other``."""
    mixed, decode = summary["mixed_steps"], summary["decode_steps"]
    step_s, mixed_s, decode_s = summary["step_s"], summary["mixed_s"], summary["decode_s"]
    return dict(
        num_steps=summary["num_steps"], step_s=round(step_s, 4),
        mixed_steps=mixed, mixed_s=round(mixed_s, 4),
        prefill_tokens=summary["mixed_prefill_tokens"],
        prefill_tokens_per_mixed_step=round(summary["mixed_prefill_tokens"] / mixed, 1) if mixed else 0.0,
        decode_steps=decode, decode_s=round(decode_s, 4),
        other_steps=summary["num_steps"] - mixed - decode, other_s=round(step_s - mixed_s - decode_s, 4),
        decode_step_ms_by_batch=summary["decode_step_ms_by_batch"], slowest_steps=summary["slowest_steps"],
        first_calls=summary["trace"][:6],  # (ms, sequences, tokens): a slow start shows which call paid it
    )


def time_split(log: StepLog, started_at: float, last_stored_at: float) -> dict[str, Any]:
    """The worker run's wall time (``started_at``: the worker's start, ``last_stored_at``: the
    last result's ``finished_at``) against the engine steps ``log`` saw in it.

    ``outside_steps_s`` = wall - seconds inside ``step()`` calls: what the worker's own thread
    spent reading jobs, preparing them and handing results on; ``to_first_step_s`` and
    ``after_last_step_s`` are its two ends, ``between_steps_s`` the rest."""
    split = steps_part(log.summary())
    wall = last_stored_at - started_at
    split["wall_s"] = round(wall, 4)
    split["outside_steps_s"] = round(wall - split["step_s"], 4)
    if log.steps:
        first = log.ended[0] - log.steps[0][0] - started_at
        last = last_stored_at - log.ended[-1]
        # the idle time before each call: from the previous call's end to this one's start
        gaps = [(log.ended[i] - log.steps[i][0] - log.ended[i - 1], i) for i in range(1, len(log.steps))]
        split.update(to_first_step_s=round(first, 4), after_last_step_s=round(last, 4),
                     between_steps_s=round(split["outside_steps_s"] - first - last, 4),
                     # (seconds, the call after it) of the longest: a stall of the worker's loop shows here
                     longest_gaps=[(round(g, 4), i) for g, i in sorted(gaps, reverse=True)[:5]])
    return split


def run_offline(llm: Any, prompts: list[list[int]], sampling: dict[str, Any]) -> dict[str, Any]:
    """The jobs through the engine alone (``bench.run.run_requests``), every request with the
    jobs' ``sampling``: jobs/s, the prefix-cache hit rate and the same step split."""
    from bench.run import Workload, run_requests
    from engine.gc_pauses import GcPauses
    from engine.sampling_params import SamplingParams

    stats = llm.llm_engine.block_manager.prefix_stats
    queried, hits = stats.queried_tokens, stats.hit_tokens
    params = [SamplingParams.from_dict(sampling) for _ in prompts]
    with GcPauses() as pauses:
        r = run_requests(llm, Workload(prompts, [p.max_tokens for p in params]), params=params)
    queried, hits = stats.queried_tokens - queried, stats.hit_tokens - hits
    seconds = max(1e-9, r["elapsed_s"])
    split = steps_part(r["steps"])
    split.update(wall_s=round(seconds, 4), outside_steps_s=round(seconds - split["step_s"], 4))
    return dict(jobs=r["num_requests"], seconds=round(seconds, 4), jobs_per_s=round(r["num_requests"] / seconds, 3),
                output_tokens=r["output_tokens"], prompt_tokens=queried, prefix_cache_hit_tokens=hits,
                prefix_cache_hit_rate=round(hits / queried, 4) if queried else 0.0,
                finished_stop=sum(1 for f in r["finish_reasons"] if f == "stop"),
                kernels_compiled_in_run=r["kernels_compiled_in_run"], time_split=split, gc=pauses.summary())


def gap(worker_s: float, offline_s: float | None, bound_s: float | None) -> dict[str, float]:
    """The worker's seconds split: bound, engine past the bound (offline - bound), worker past
    the engine (worker - offline); whichever of them were measured."""
    out: dict[str, float] = dict(worker_s=worker_s)
    if offline_s is not None:
        out.update(offline_s=offline_s, worker_past_offline_s=round(worker_s - offline_s, 4),
                   worker_over_offline=round(worker_s / offline_s, 4))
    if bound_s is not None:
        out.update(bound_s=round(bound_s, 4), worker_fraction=round(bound_s / worker_s, 4))
        if offline_s is not None:
            out.update(offline_past_bound_s=round(offline_s - bound_s, 4),
                       offline_fraction=round(bound_s / offline_s, 4))
    return out


def gap_lines(g: dict[str, float]) -> list[str]:
    """The printed form of ``gap``: nothing when only the worker was measured."""
    if len(g) == 1:
        return []
    parts = [f"worker {g['worker_s']:.2f} s"]
    if "offline_s" in g:
        parts.append(f"engine alone {g['offline_s']:.2f} s (the worker adds {g['worker_past_offline_s']:.2f} s)")
    if "bound_s" in g:
        engine = f" (the engine adds {g['offline_past_bound_s']:.2f} s)" if "offline_past_bound_s" in g else ""
        parts.append(f"bound {g['bound_s']:.2f} s{engine}")
    return ["  gap: " + " / ".join(parts)]


def gc_line(gc: dict[str, Any] | None, who: str) -> list[str]:
    """The collector's pauses inside a run, when it paused at all."""
    if not gc or not gc["total_s"]:
        return []
    counts = "/".join(str(n) for n in gc["collections"])
    return [f"  {who} garbage-collector pauses: {gc['total_s']:.3f} s in {counts} collections (generations 0/1/2), "
            f"longest full one {gc['longest_ms'][2]:.1f} ms"]


def split_lines(split: dict[str, Any], who: str) -> list[str]:
    """The printed form of a ``time_split``/``run_offline`` split."""
    line = (f"  {who} steps: {split['num_steps']} calls, {split['step_s']:.2f} s inside step(): "
            f"{split['mixed_steps']} with prompt tokens {split['mixed_s']:.2f} s "
            f"({split['prefill_tokens_per_mixed_step']:.0f} prompt tokens each), {split['decode_steps']} decode-only "
            f"{split['decode_s']:.2f} s")
    if split["other_steps"]:
        line += f", {split['other_steps']} that waited on no step {split['other_s']:.2f} s"
    lines = [line]
    outside = f"  {who} outside steps: {split['outside_steps_s']:.2f} s of {split['wall_s']:.2f} s"
    if "to_first_step_s" in split:
        outside += (f" (start to first step {split['to_first_step_s']:.3f} s, between steps "
                    f"{split['between_steps_s']:.2f} s, last step to last result stored "
                    f"{split['after_last_step_s']:.3f} s)")
    lines.append(outside)
    if split.get("first_calls"):
        calls = ", ".join(f"{ms:.0f} ms ({n} seqs, {t} tokens)" for ms, n, t in split["first_calls"][:4])
        lines.append(f"  {who} first calls: {calls}")
    if split.get("longest_gaps"):
        gaps = ", ".join(f"{1e3 * g:.1f} ms before call {i}" for g, i in split["longest_gaps"][:3])
        lines.append(f"  {who} longest gaps between steps: {gaps}")
    return lines


def roofline_lines(roof: dict[str, Any], worker: dict[str, Any], offline: dict[str, Any] | None) -> list[str]:
    """The bound's prefill and decode parts beside the measured steps (worker's, and offline's)."""
    lines = []
    for who, run in (("worker", worker), ("offline", offline)):
        if run is None or "time_split" not in run:
            continue
        s = run["time_split"]
        lines.append(f"  {who} vs the bound ({100 * roof['bound_s'] / run['seconds']:.0f}% of it): steps with prompt "
                     f"tokens {s['mixed_s']:.2f} s against the prefill bound {roof['prefill_bound_s']:.2f} s, "
                     f"decode-only steps {s['decode_s']:.2f} s against the decode bound {roof['decode_bound_s']:.2f} s")
    return lines
