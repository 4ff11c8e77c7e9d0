"""Where does batch-1 time to first token go, with and without async scheduling?

    python scripts/ttft_probe.py [--no-async] [--model llama3-8b] [--input-len 128]

Runs a few single requests (greedy, 4 tokens) through ``LLMEngine.step`` and prints, for the
first steps of the last one, each engine phase's host start and end and when the GPU reached
that point of the stream (a timing event recorded at the phase's start), all in ms from the
request's arrival. Host and GPU columns side by side say whether the host waits on the device
or the device idles waiting on the host.
"""
from __future__ import annotations

import argparse
import time

import torch

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.runner import sampler as sampler_module

parser = argparse.ArgumentParser()
parser.add_argument("--no-async", action="store_true")
parser.add_argument("--model", default="llama3-8b")
parser.add_argument("--input-len", type=int, default=128)
parser.add_argument("--iters", type=int, default=4)
parser.add_argument("--cprofile", action="store_true", help="then profile one more request's prefill step on the host")
parser.add_argument("--prefill-graph-tokens", type=int, default=0, help="replay prompt steps as piecewise graphs")
args = parser.parse_args()

engine = LLMEngine(EngineArgs(model=args.model, load_format="dummy", max_num_seqs=1, max_model_len=args.input_len + 8,
                              async_scheduling=not args.no_async, prefill_graph_tokens=args.prefill_graph_tokens))
CUDA = torch.cuda.is_available()
records: list[tuple[str, float, float, torch.cuda.Event]] = []


def traced(name, fn):
    def wrapper(*a, **kw):
        event = torch.cuda.Event(enable_timing=True) if CUDA else None
        if event is not None:
            event.record()
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            records.append((name, start, time.perf_counter(), event))
    return wrapper


engine.scheduler.schedule = traced("schedule", engine.scheduler.schedule)
engine._execute = traced("_execute", engine._execute)
engine._postprocess = traced("_postprocess", engine._postprocess)
engine.executor.execute = traced("executor.execute", engine.executor.execute)
engine.sampler.sample = traced("sampler.sample", engine.sampler.sample)
sampler_module.DeviceSample.result = traced("DeviceSample.result", sampler_module.DeviceSample.result)
runner = getattr(engine.executor, "runner", None)
if runner is not None:
    runner.prepare = traced("runner.prepare", runner.prepare)
    runner.execute = traced("runner.execute", runner.execute)
    if runner.graphs is not None:
        runner.graphs.run = traced("graphs.run", runner.graphs.run)
    runner.model.compute_logits = traced("compute_logits", runner.model.compute_logits)

gen = torch.Generator().manual_seed(0)
for it in range(args.iters):
    prompt = torch.randint(0, min(32000, engine.vocab_size), (args.input_len,), generator=gen).tolist()
    if CUDA:
        torch.cuda.synchronize()
    records.clear()
    zero_event = torch.cuda.Event(enable_timing=True) if CUDA else None
    if zero_event is not None:
        zero_event.record()
    t0 = time.perf_counter()
    engine.add_request(f"r{it}", None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       prompt_token_ids=prompt)
    steps = []
    first = None
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        steps.append((s, e, sum(len(o.outputs[0].token_ids) for o in outs)))
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = e - t0
    if CUDA:
        torch.cuda.synchronize()
    print(f"iter {it} ({'sync' if args.no_async else 'async'}): TTFT {1e3 * first:.2f} ms, steps "
          + ", ".join(f"[{1e3 * (s - t0):.2f}-{1e3 * (e - t0):.2f} tok {n}]" for s, e, n in steps), flush=True)
    if it == args.iters - 1:
        for name, start, end, event in sorted(records, key=lambda r: r[1]):
            if start - t0 > 0.06:
                break
            gpu = zero_event.elapsed_time(event) if CUDA else float("nan")
            print(f"   {name:22s} host {1e3 * (start - t0):8.2f} -> {1e3 * (end - t0):8.2f} ms   "
                  f"gpu reached start at {gpu:8.2f} ms")
if args.cprofile:
    import cProfile
    import pstats

    engine.add_request("profiled", None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       prompt_token_ids=prompt)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.step()  # the prefill's launch (and, without async scheduling, its read-back)
    profiler.disable()
    while engine.has_unfinished_requests():
        engine.step()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
engine.shutdown()
