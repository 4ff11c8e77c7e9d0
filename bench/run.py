"""A timed run of a workload through the engine: random prompts, per-step statistics (each
``engine.step()`` call charged to the step it waited for), optional torch.profiler windows,
and a count of Triton kernels compiled inside the timing. Every engine workload of the
bench builds on it.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.observer import StepRecord

# NOTE: inside a profile window each engine.step() call is one range of this name, so a trace
# shows where a step begins and ends; the engine's own phases carry no labels (that would
# cost every step, profiled or not).
STEP_LABEL = "step"


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def describe(self) -> dict[str, Any]:
        return dict(num_requests=len(self.prompts), input_tokens=sum(self.input_lens),
                    output_tokens=sum(self.output_lens), max_input_len=max(self.input_lens),
                    max_output_len=max(self.output_lens))


def make_workload(num_requests: int, input_len: int, output_len: int, vocab_size: int,
                  range_ratio: float = 0.0, seed: int = 0) -> Workload:
    """Random prompts; lengths fixed, or uniform in ``[len * (1 - r), len * (1 + r)]`` (seeded)."""
    rng = random.Random(seed)

    def length(center: int) -> int:
        if range_ratio <= 0:
            return center
        return rng.randint(max(1, int(center * (1 - range_ratio))), max(1, int(center * (1 + range_ratio))))

    prompts, outs = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(vocab_size) for _ in range(length(input_len))])
        outs.append(length(output_len))
    return Workload(prompts, outs)


class StepLog:
    """Per-step wall time, batch and token counts, from the engine's step records.

    Subscribe it with ``engine.add_step_observer(log)``. Each ``engine.step()`` call is
    charged to the step it waited for (``StepRecord.waited_for``): asynchronous on a GPU, a
    call launches its step and waits for the step the call before launched, so its time
    belongs to that one; on the CPU the forward runs inside the launch and the time is the
    launched step's own.
    """

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, bool]] = []  # (seconds, seqs, tokens, decode only)
        # tokens each call handed back; with async scheduling a call returns the previous step's
        self.sampled: list[int] = []
        self.records: list[StepRecord] = []
        self.prefill: list[int] = []  # prompt (chunk) tokens of the step each call waited for
        self.ended: list[float] = []  # time.time() at the end of each call

    def __call__(self, record: StepRecord) -> None:
        """One ``engine.step()`` call: its time, charged to the step it waited for."""
        self.ended.append(time.time())
        self.records.append(record)
        waited = next((r for r in self.records[-2:] if r.step == record.waited_for), None)
        seqs, tokens = (waited.num_seqs, waited.num_batched_tokens) if waited is not None else (0, 0)
        self.steps.append((record.duration_s, seqs, tokens, tokens == seqs))
        self.prefill.append(waited.num_prefill_tokens if waited is not None else 0)
        self.sampled.append(record.num_generated_tokens)

    def summary(self) -> dict[str, Any]:
        decode = [(s, n) for s, n, _, only in self.steps if only and n]
        mixed = [(s, t) for s, _, t, only in self.steps if not only]
        by_batch: dict[str, list[float]] = {}
        for s, n in decode:
            bucket = 1 << (n - 1).bit_length()  # batches up to a power of two
            by_batch.setdefault(f"<={bucket}", []).append(s)
        return dict(
            num_steps=len(self.steps),
            step_s=sum(s for s, *_ in self.steps),  # every call's, those that waited for no step included
            decode_steps=len(decode),
            decode_s=sum(s for s, _ in decode),
            mixed_steps=len(mixed),
            mixed_s=sum(s for s, _ in mixed),
            mixed_tokens=sum(t for _, t in mixed),
            mixed_prefill_tokens=sum(p for p, (_, _, _, only) in zip(self.prefill, self.steps) if not only),
            decode_step_ms_by_batch={k: round(1e3 * statistics.median(v), 3) for k, v in sorted(
                by_batch.items(), key=lambda kv: int(kv[0][2:]))},
            # (ms, sequences, tokens) of the slowest steps: outliers such as a kernel compiled mid-run
            slowest_steps=[(round(1e3 * s, 2), n, t) for s, n, t, _ in sorted(self.steps, reverse=True)[:5]],
            # every call in order: (ms, sequences, tokens) of the step it waited for
            trace=[(round(1e3 * s, 2), n, t) for s, n, t, _ in self.steps],
        )


def parse_windows(text: str | None) -> list[tuple[int, int]]:
    """``"30:33,200:205"`` -> [(30, 33), (200, 205)]: step index ranges to profile."""
    if not text:
        return []
    windows = []
    for part in text.split(","):
        a, b = part.split(":")
        windows.append((int(a), int(b)))
    return windows


def run_requests(llm, workload: Workload, profile_dir: str | None = None,
                 profile_windows: list[tuple[int, int]] = (), params: list | None = None) -> dict[str, Any]:
    """Run the workload to completion (greedy, ignore_eos); returns timings and step statistics.

    ``params``: each request's own ``SamplingParams`` instead (the result then also holds
    each request's ``output_lens`` and ``finish_reasons``, in the workload's order)."""
    import torch
    from torch.profiler import record_function

    from engine import SamplingParams

    engine = llm.llm_engine
    log = StepLog()
    for i, (prompt, out) in enumerate(zip(workload.prompts, workload.output_lens)):
        p = params[i] if params is not None else SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        engine.add_request(f"bench-{i}", None, p, prompt_token_ids=prompt, final_only=True)
    windows = sorted(profile_windows)
    profiles = []
    prof = None
    outputs = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    cached_kernels = triton_cache_entries()
    after_profiler = _profiled
    engine.add_step_observer(log)
    start = time.perf_counter()
    step = 0
    try:
        while engine.has_unfinished_requests():
            if windows and prof is None and step == windows[0][0]:
                prof = _start_profiler()
                window_start = time.perf_counter()
            if prof is None:
                outputs.extend(engine.step())
            else:
                with record_function(STEP_LABEL):
                    outputs.extend(engine.step())
            step += 1
            if prof is not None and step == windows[0][1]:
                sync()
                profiles.append(_stop_profiler(prof, windows.pop(0), time.perf_counter() - window_start, profile_dir))
                prof = None
        sync()
        elapsed = time.perf_counter() - start
    finally:
        engine.remove_step_observer(log)
    if prof is not None:
        prof.stop()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs if o.metrics.first_token_time]
    per_request = {}
    if params is not None:
        ordered = sorted(outputs, key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
        per_request = dict(output_lens=[len(o.outputs[0].token_ids) for o in ordered],
                           finish_reasons=[o.outputs[0].finish_reason for o in ordered])
    return dict(**per_request,
        elapsed_s=elapsed, num_requests=len(outputs), input_tokens=in_tokens, output_tokens=out_tokens,
        output_tok_s=out_tokens / elapsed, total_tok_s=(in_tokens + out_tokens) / elapsed,
        ttft_p50_s=percentile(ttft, 50), steps=log.summary(), step_times=[s for s, *_ in log.steps],
        step_tokens=list(log.sampled),
        kernels_compiled_in_run=count_new(cached_kernels, triton_cache_entries()),
        profiles=profiles, after_profiler=after_profiler,
    )


def triton_cache_entries() -> int | None:
    """Entries in Triton's kernel cache (every rank of a run shares it); None if unreadable."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        return len(os.listdir(path))
    except OSError:
        return None


def count_new(before: int | None, after: int | None) -> int | None:
    """Kernels compiled between two cache readings: a timed run should compile none (the
    warm-up is there for that); any it does are inside its time."""
    return None if before is None or after is None else after - before


_profiled = False  # whether this process has started torch.profiler (CUPTI then stays attached)

# the CUDA runtime and driver calls that put work on a stream, as torch.profiler names them
HOST_LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
    "cudaMemcpyAsync", "cudaMemsetAsync",
})


def _start_profiler():
    from torch.profiler import ProfilerActivity, profile

    global _profiled
    _profiled = True
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    return prof


def _stop_profiler(prof, window: tuple[int, int], wall_s: float, profile_dir: str | None) -> dict[str, Any]:
    from torch.autograd import DeviceType

    prof.stop()
    # device events, less the ranges our own labels put on the GPU timeline
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name != STEP_LABEL]
    gpu_s = sum(e.self_device_time_total for e in kernels) / 1e6
    by_kernel: dict[str, float] = {}
    for e in kernels:
        by_kernel[e.name] = by_kernel.get(e.name, 0.0) + e.self_device_time_total / 1e6
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]
    own, idle_s = own_times([(e.time_range.start / 1e6, e.time_range.end / 1e6, e.name) for e in kernels])
    num_steps = max(1, window[1] - window[0])
    copies = sum(1 for e in kernels if e.name.startswith(("Memcpy", "Memset")))
    # what the host asked the driver for: a graph replay is one call however many kernels it holds
    host_calls = sum(1 for e in prof.events() if e.device_type == DeviceType.CPU and e.name in HOST_LAUNCH_CALLS)
    info = dict(steps=f"{window[0]}:{window[1]}", wall_s=wall_s, gpu_busy_s=gpu_s,
                gpu_busy_fraction=gpu_s / wall_s if wall_s else 0.0,
                # every device activity (kernels, copies, memsets), CUDA-graph replays counted node by node
                launches_per_step=len(kernels) / num_steps, kernels_per_step=(len(kernels) - copies) / num_steps,
                host_launch_calls_per_step=host_calls / num_steps,
                top_kernels=[(name[:90], round(s * 1e3, 3)) for name, s in top],
                # the timeline's share of each: not counting what it spent beside a kernel that began
                # before it (a kernel launched early by PDL waits inside its own span), and the idle gaps
                top_kernels_own=[(name[:90], round(s * 1e3, 3))
                                 for name, s in sorted(own.items(), key=lambda kv: -kv[1])[:25]],
                gpu_idle_s=idle_s)
    if profile_dir:
        path = Path(profile_dir)
        path.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
        tag = f"steps{window[0]}-{window[1]}"
        (path / f"profile_{tag}.txt").write_text(table)
        info["table"] = str(path / f"profile_{tag}.txt")
    return info


def own_times(spans: list[tuple[float, float, str]]) -> tuple[dict[str, float], float]:
    """Each name's own share of a device timeline of ``(start, end, name)`` spans, and the time
    no span covers: a span counts only past the end of every span that began before it, so the
    shares and the idle time add up to the timeline from the first start to the last end.

    NOTE: with programmatic dependent launch a kernel starts while the one before it runs and
    waits inside its own span: its device time then holds the other's, its own share does not."""
    own: dict[str, float] = {}
    idle = 0.0
    covered = None  # the latest end so far
    for start, end, name in sorted(spans):
        if covered is not None and start > covered:
            idle += start - covered
        begin = start if covered is None else max(start, covered)
        own[name] = own.get(name, 0.0) + max(0.0, end - begin)
        covered = end if covered is None else max(covered, end)
    return own, idle


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
