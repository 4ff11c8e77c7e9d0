"""``bench mixed``'s numbers: latency percentiles, throughput, the swap pool over time, the summary lines."""

from __future__ import annotations

import math
from typing import Any

GB = 1e9
GIB = 1 << 30


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by the nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# The stages of a job's wait for its first token, each from the end of the one before:
# (name, the result's timing at the stage's end, measured from enqueued).
STAGES = (("read", "read_s"), ("ready", "ready_s"), ("admitted", "queue_s"), ("scheduled", "scheduled_s"),
          ("launched", "launched_s"), ("first_token", None))


def stage_times(t: dict[str, Any]) -> dict[str, float] | None:
    """One job's seconds in each stage (enqueued -> read by the worker -> prompt ready as token ids
    -> added to the engine -> first scheduled -> that step launched -> first token), or None when
    a timing is missing."""
    ends = [t.get(key) if key else None for _, key in STAGES]
    if t.get("queue_s") is None or t.get("ttft_s") is None:
        return None
    ends[-1] = t["queue_s"] + t["ttft_s"]
    if any(e is None for e in ends):
        return None
    out, before = {}, 0.0
    for (name, _), end in zip(STAGES, ends):
        out[name] = max(0.0, end - before)
        before = max(before, end)
    return out


def stages(rows: list[dict[str, Any]], started: float | None = None) -> dict[str, Any]:
    """p50/p99/max of each stage over the jobs, and the stages of the three slowest to their first
    token, with when each was enqueued (``at_s``, seconds after ``started``, the backlog's submission)."""
    per_job = []
    for row in rows:
        result = row["result"]
        if row["status"] == "done" and result is not None:
            times = stage_times(result["timings"])
            if times is not None:
                per_job.append(times)
                total = result["timings"].get("total_s")
                if started and total is not None and row.get("finished_at"):
                    times["at_s"] = round(row["finished_at"] - total - started, 3)
    summary: dict[str, Any] = {}
    for name, _ in STAGES:
        values = [job[name] for job in per_job]
        summary[name] = dict(p50_s=percentile(values, 0.5), p99_s=percentile(values, 0.99),
                             max_s=max(values) if values else None)
    summary["slowest"] = sorted(per_job, key=lambda job: -sum(job[name] for name, _ in STAGES))[:3]
    return summary


def stalls(rows: list[dict[str, Any]], sampler: Any, step_loop: str, jobs: int = 3,
           min_stage_s: float = 0.005) -> list[dict[str, Any]]:
    """For the ``jobs`` slowest jobs to their first token, each stage of ``min_stage_s`` or more:
    where the step loop's thread sat meanwhile and which other threads were busiest
    (``bench/stack_sampler.py``), from the stage's wall-clock window."""
    slow = []
    for row in rows:
        result = row["result"]
        if row["status"] != "done" or result is None or not row.get("finished_at"):
            continue
        t = result["timings"]
        times = stage_times(t)
        if times is None or t.get("total_s") is None:
            continue
        slow.append((sum(times.values()), row["finished_at"] - t["total_s"], times))
    out = []
    for _, enqueued, times in sorted(slow, key=lambda s: -s[0])[:jobs]:
        stages_out, start = {}, enqueued
        for name, seconds in times.items():
            end = start + seconds
            if seconds >= min_stage_s:
                stages_out[name] = dict(seconds=round(seconds, 4), step_loop=sampler.window(start, end, step_loop),
                                        busiest_others=sampler.busiest(start, end, exclude=step_loop))
            start = end
        out.append(dict(enqueued=round(enqueued, 3), ttft_s=round(sum(times.values()), 4), stages=stages_out))
    return out


def latencies(rows: list[dict[str, Any]], started: float | None = None) -> dict[str, Any]:
    """TTFT (enqueued -> first token: the result's ``queue_s + ttft_s``) and per-token latency
    (first token -> finished, per later token) of the jobs that ended ``done``, and where the
    wait for the first token went (``stages``)."""
    ttft, tpot = [], []
    for row in rows:
        result = row["result"]
        if row["status"] != "done" or result is None:
            continue
        t = result["timings"]
        if t.get("ttft_s") is None or t.get("queue_s") is None:
            continue
        first = t["queue_s"] + t["ttft_s"]
        ttft.append(first)
        tokens = result["usage"]["completion_tokens"]
        if tokens > 1 and t.get("total_s") is not None:
            tpot.append(max(0.0, t["total_s"] - first) / (tokens - 1))
    return dict(jobs=len(rows), done=len(ttft), ttft_p50_s=percentile(ttft, 0.5), ttft_p90_s=percentile(ttft, 0.9),
                ttft_p95_s=percentile(ttft, 0.95), ttft_p99_s=percentile(ttft, 0.99), ttft_max_s=max(ttft) if ttft else None, tpot_p50_s=percentile(tpot, 0.5),
                tpot_p99_s=percentile(tpot, 0.99), stages=stages(rows, started))


def throughput(rows: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """Output tokens of the jobs over the time from the backlog's submission to its last result."""
    done = [r for r in rows if r["status"] == "done" and r["result"] is not None]
    if not done:
        return dict(jobs=len(rows), done=0, output_tokens=0, seconds=0.0, output_tok_s=0.0)
    tokens = sum(r["result"]["usage"]["completion_tokens"] for r in done)
    seconds = max(1e-9, max(r["finished_at"] for r in done) - started)
    return dict(jobs=len(rows), done=len(done), output_tokens=tokens, seconds=round(seconds, 3),
                output_tok_s=round(tokens / seconds, 2))


def pool_over_time(samples: list[dict[str, float]], every: int = 1) -> dict[str, Any]:
    """The swap pool's size (capacity) and resident host memory, sampled, plus its range."""
    pools = [s["pool_bytes"] for s in samples]
    return dict(samples=samples[::every],
                pool_gib_min=min(pools) / GIB if pools else None, pool_gib_max=max(pools) / GIB if pools else None,
                pool_gib_last=pools[-1] / GIB if pools else None,
                swapped_max=max((s["swapped"] for s in samples), default=0))


def summarize_phase(urgent: list[dict[str, Any]], bulk: list[dict[str, Any]], samples: list[dict[str, float]],
                    started: float, stats: dict[str, int], swap_time: dict[str, float],
                    steps: list[Any] | None = None) -> dict[str, Any]:
    moved = stats.get("swap_out_bytes", 0) + stats.get("swap_in_bytes", 0)
    every = max(1, len(samples) // 240)  # at most ~240 points in the JSON
    return dict(interactive=latencies(urgent, started), bulk=throughput(bulk, started), stats=stats,
                swap_gb_moved=moved / GB, swap_time=swap_time, swap_pool=pool_over_time(samples, every),
                steps=step_times(steps or []),
                interactive_first_steps=first_steps(steps or [], [row["id"] for row in urgent]))


def step_times(records: list[Any]) -> dict[str, Any]:
    """The step loop's ``step()`` calls (``engine.observer.StepRecord``): p50/p99/max seconds of
    those that launched prompt tokens and of those that launched decodes only, and the five
    longest with what they launched: the steps an arriving job waits behind."""
    def summary(durations: list[float]) -> dict[str, Any]:
        return dict(n=len(durations), p50_s=percentile(durations, 0.5), p99_s=percentile(durations, 0.99),
                    max_s=max(durations) if durations else None)
    longest = sorted((r for r in records if r.num_seqs), key=lambda r: -r.duration_s)[:5]
    return dict(
        with_prompt=summary([r.duration_s for r in records if r.num_prefill_tokens]),
        decode_only=summary([r.duration_s for r in records if not r.num_prefill_tokens and r.num_seqs]),
        longest=[dict(step=r.step, duration_s=round(r.duration_s, 4), num_seqs=r.num_seqs,
                      prefill_tokens=r.num_prefill_tokens, decode_tokens=r.num_decode_tokens) for r in longest],
    )


def first_steps(records: list[Any], job_ids: list[str]) -> dict[str, Any]:
    """The steps that first scheduled the interactive jobs' prompts: how their forwards ran
    (``StepRecord.forward``: one whole-step graph replay, or graph pieces with attention
    launched between them) and what else they carried -- what a job's own step costs."""
    wanted = set(job_ids)
    mine = [r for r in records if wanted.intersection(r.first_scheduled)]
    forwards: dict[str, int] = {}
    for r in mine:
        forwards[r.forward or "none"] = forwards.get(r.forward or "none", 0) + 1
    # NOTE: a prompt run in the express lane by a call that then went on to launch the next step
    # is in that call's ``express``, not its ``first_scheduled``
    lane = sum(len(wanted.intersection(r.express)) for r in records if not wanted.intersection(r.first_scheduled))
    if lane:
        forwards["express_lane"] = lane

    def dist(values: list[int]) -> dict[str, Any]:
        return dict(p50=percentile(values, 0.5), max=max(values) if values else None)
    return dict(n=len(mine), forward=forwards, num_seqs=dist([r.num_seqs for r in mine]),
                prefill_tokens=dist([r.num_prefill_tokens for r in mine]),
                decode_tokens=dist([r.num_decode_tokens for r in mine]))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.0f} ms"


def lines(result: dict[str, Any]) -> list[str]:
    o = result["options"]
    out = [f"mixed  {o['model']} {o['dtype']}  bulk {o['bulk_requests']} x {o['bulk_input_len']} in / "
           f"{o['bulk_output_len']} out, interactive {o['interactive_rate']}/s x {o['interactive_input_len']} in / "
           f"{o['interactive_output_len']} out, {result['num_gpu_blocks']} KV blocks, swap {o['swap_space']}"]
    idle = result.get("idle")
    if idle:
        out.append(f"  idle engine: interactive TTFT p50 {_ms(idle['ttft_p50_s'])}, p99 {_ms(idle['ttft_p99_s'])}, "
                   f"per token {_ms(idle['tpot_p50_s'])}")
    for mode, alone in result.get("bulk_alone", {}).items():
        out.append(f"  bulk alone ({mode}): {alone['bulk']['output_tok_s']:.0f} output tok/s "
                   f"({alone['stats'].get('num_preemptions', 0)} preemptions, {alone['swap_gb_moved']:.1f} GB swapped, "
                   f"{alone['stats'].get('num_prompt_tokens', 0)} prompt tokens computed)")
    for mode, run in result["runs"].items():
        i, b, st = run["interactive"], run["bulk"], run["stats"]
        vs_alone = run.get("bulk_vs_alone")
        vs_idle = run.get("ttft_p99_vs_idle")
        out.append(
            f"  {mode}: interactive TTFT p50 {_ms(i['ttft_p50_s'])} p99 {_ms(i['ttft_p99_s'])}"
            f" ({'-' if vs_idle is None else f'{vs_idle:.1f}x'} idle), per token p50 {_ms(i['tpot_p50_s'])}"
            f" p99 {_ms(i['tpot_p99_s'])} ({i['done']} jobs); bulk {b['output_tok_s']:.0f} tok/s"
            f" ({'-' if vs_alone is None else f'{vs_alone:.2f}x'} alone); {st.get('num_rank_preemptions', 0)} rank"
            f" preemptions of {st.get('num_preemptions', 0)}, {st.get('num_recomputes', 0)} recomputed,"
            f" {run['swap_gb_moved']:.1f} GB swapped, {st.get('num_prompt_tokens', 0)} prompt tokens computed; pool {run['swap_pool']['pool_gib_min'] or 0:.2f}"
            f"-{run['swap_pool']['pool_gib_max'] or 0:.2f} GiB, last {run['swap_pool']['pool_gib_last'] or 0:.2f}")
        out.append(f"    {mode} stages p50/p99: " + stage_line(i.get("stages")))
        first = run.get("interactive_first_steps")
        if first and first["n"]:
            out.append(f"    {mode} interactive jobs' own steps: forward {first['forward']}, sequences p50 "
                       f"{first['num_seqs']['p50']}, prompt tokens p50 {first['prefill_tokens']['p50']} (max "
                       f"{first['prefill_tokens']['max']}), decodes p50 {first['decode_tokens']['p50']} "
                       f"(max {first['decode_tokens']['max']})")
        steps = run.get("steps")
        if steps:
            out.append(f"    {mode} step() calls p50/p99/max: with prompt tokens " + _step_line(steps["with_prompt"])
                       + ", decodes only " + _step_line(steps["decode_only"]))
        st_time = run.get("swap_time", {})
        if "resizes" in st_time:
            out.append(f"    {mode} pool resizes on the step loop: {st_time['resizes']}, "
                       f"{_ms(st_time['resize_s_total'])} in all, longest {_ms(st_time['resize_s_max'])}")
        if run.get("step_loop"):
            out.append(f"    {mode} step loop's samples while the backlog ran: "
                       + ", ".join(f"{part} {share:.0%}" for part, share in run["step_loop"].items()))
        for job in run.get("stalls", []):
            out.append(f"    {mode} slow job, TTFT {_ms(job['ttft_s'])}: " + "; ".join(
                f"{name} {_ms(stage['seconds'])} at {_top(stage['step_loop'])}"
                + "".join(f", {w['thread']} at {_top(w)}" for w in stage["busiest_others"][:1])
                for name, stage in job["stages"].items()))
    return out


def _top(window: dict[str, Any]) -> str:
    """A sampler window's most common stack, innermost frame first, and its share of the samples."""
    if not window["stacks"]:
        return f"(no samples of {window['seconds'] * 1e3:.0f} ms)"
    stack = window["stacks"][0]
    cpu = "" if window.get("cpu_s") is None else f", cpu {1e3 * window['cpu_s']:.1f} ms"
    return f"{' < '.join(stack['frames'][:3])} ({100 * stack['share']:.0f}% of {window['samples']}{cpu})"


def _step_line(s: dict[str, Any]) -> str:
    return f"{_ms(s['p50_s'])}/{_ms(s['p99_s'])}/{_ms(s['max_s'])} ({s['n']})"


def stage_line(summary: dict[str, Any] | None) -> str:
    if not summary:
        return "-"
    return ", ".join(f"{name} {_ms(summary[name]['p50_s'])}/{_ms(summary[name]['p99_s'])}" for name, _ in STAGES)
