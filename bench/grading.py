"""``sluiceway bench grading``: grading jobs that share one long rubric, through Redis and a worker.

N jobs, each the same ``--rubric-len``-token rubric, its own ``--answer-len``-token answer and
a short verdict instruction, asking for a verdict of ``--verdict-tokens`` tokens (greedy, EOS
ignored); ``--verdict choice`` constrains it to ``--choices`` with structured outputs instead
(a model without a tokenizer, such as a preset, gets the bench's BPE of its vocabulary) and
counts the verdicts that are not one of the choices (0 expected). All jobs are submitted to
a private redis-server first, then a worker in this process drains them on one engine, timed
from its start to the last result stored. Reported: jobs/s, the prefix-cache hit rate over
the jobs' prompt tokens (the rubric should be computed about once), where the worker's time
went (``bench.grading_split``: engine steps with prompt tokens, decode-only steps, the time
outside steps), the same kind of jobs through the engine alone (``--offline``, a fresh
rubric), the roofline bound of this workload with the shared prefix computed once
(``--roofline``, a GPU) with its prefill and decode parts beside the measured steps, and HF
transformers on the same jobs in the same run (``--peer hf``), which computes every prompt whole.

    sluiceway bench grading --model llama3-8b --num-jobs 2048 --offline --roofline --json grading.json
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click

from bench.common import ENGINE_KEYS, build_llm, emit, engine_options, environment
from bench.grading_split import gap, gap_lines, gc_line, roofline_lines, run_offline, split_lines, time_split
from bench.run import StepLog, Workload, count_new, triton_cache_entries
from bench.stack_sampler import StackSampler
from bench.structured import bench_tokenizer
from engine.gc_pauses import GcPauses, freeze_startup_heap, thaw_startup_heap

logger = logging.getLogger(__name__)

# a folder holding one of these has a tokenizer of its own (HF's file names)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass
class GradingJobs:
    rubric: list[int]
    suffixes: list[list[int]]  # each job's answer and verdict instruction
    verdict_tokens: int

    @property
    def prompts(self) -> list[list[int]]:
        return [self.rubric + s for s in self.suffixes]

    def workload(self) -> Workload:
        return Workload(self.prompts, [self.verdict_tokens] * len(self.suffixes))


def make_jobs(num_jobs: int, rubric_len: int, answer_len: int, instruction_len: int, verdict_tokens: int,
              vocab_size: int, seed: int) -> GradingJobs:
    """Random token ids (dummy weights need no text): one rubric, one instruction, N answers."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, vocab_size) for _ in range(n)]  # noqa: E731
    rubric, instruction = ids(rubric_len), ids(instruction_len)
    return GradingJobs(rubric, [ids(answer_len) + instruction for _ in range(num_jobs)], verdict_tokens)


def verdict_sampling(mode: str, verdict_tokens: int, choices: list[str]) -> dict[str, Any]:
    """The jobs' ``sampling``: a plain greedy verdict, or one constrained to ``choices``."""
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": verdict_tokens}
    if mode == "tokens":
        sampling["ignore_eos"] = True
        return sampling
    sampling["structured_outputs"] = {"choice": choices}
    return sampling


def verdict_tokenizer(model: str, hf_config: Any) -> str | None:
    """The tokenizer a ``--verdict choice`` run gives the engine: None where the model has its
    own; for one that has none (a preset, a folder of a config alone) the bench's BPE of its
    vocabulary (``bench.structured.bench_tokenizer``), which a grammar's vocabulary needs."""
    from engine.models.presets import is_preset

    folder = Path(model).expanduser()
    if folder.is_dir():
        if any((folder / name).is_file() for name in _TOKENIZER_FILES):
            return None
    elif not is_preset(model):
        return None  # a hub id: its snapshot's tokenizer
    return bench_tokenizer(hf_config)


def run_through_worker(engine: Any, model: str, jobs: GradingJobs, sampling: dict[str, Any], appendonly: bool,
                       log: StepLog | None = None, choices: list[str] | None = None,
                       queues: str | None = None, sample_stacks: bool = False) -> dict[str, Any]:
    """Submit every job (to queue ``bulk``), start a worker on ``engine``, wait for every result;
    jobs/s and hit rate.

    ``sample_stacks``: sample the worker's threads' stacks for the run's first seconds and
    report, for each of the first calls of ``step()`` over 100 ms (``log`` needed), where the
    step loop sat and which other thread was busy (``bench/stack_sampler.py``).

    ``log`` observes the engine's steps while the worker runs (``time_split`` reads it);
    ``choices``: count the verdicts that are not one of them; ``queues``: the worker's
    ``--queues`` (default: its own)."""
    from producers.client import Client
    from worker.embedded_redis import EmbeddedRedis
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    stats = engine.block_manager.prefix_stats
    queried, hits = stats.queried_tokens, stats.hit_tokens
    cached_kernels = triton_cache_entries()
    pauses = GcPauses()
    with EmbeddedRedis(appendonly=appendonly) as server, Client(server.url, queue="bulk", socket_timeout=600) as client:
        ids = client.submit_many({"prompt_token_ids": p, "sampling": sampling} for p in jobs.prompts)
        extra = {"queues": queues} if queues else {}
        settings = WorkerSettings(model=model, redis=server.url, name="bench-grading", swap_space="0",
                                  log_level="WARNING", **extra)
        worker = Worker(settings, engine=engine)
        thread = threading.Thread(target=worker.work, name="sluiceway-bench-grading", daemon=True)
        if log is not None:
            engine.add_step_observer(log)
        started_wall = time.time()
        pauses.install()
        sampler = StackSampler(duration_s=4.0).start() if sample_stacks else None
        thread.start()
        for job_id in ids:  # NOTE: only the done signals while timing, as bench worker does
            done = client.keys.done(job_id)
            while client.redis.blmove(done, done, 60, "RIGHT", "LEFT") is None:
                if not thread.is_alive():
                    raise RuntimeError("the worker stopped before every job ended")
        pauses.uninstall()
        if sampler is not None:
            sampler.stop()
        worker.request_stop()
        thread.join(60)
        if log is not None:
            engine.remove_step_observer(log)
        with client.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(client.keys.job(job_id), ["status", "finished_at", "result", "error"])
            rows = pipe.execute()
    bad = [(status, error) for status, _, _, error in rows if status != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not end done, e.g. {bad[0]}")
    last_stored = max(float(finished) for _, finished, _, _ in rows)
    seconds = max(1e-9, last_stored - started_wall)
    results = [json.loads(result) for _, _, result, _ in rows]
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    queried, hits = stats.queried_tokens - queried, stats.hit_tokens - hits
    run = dict(jobs=len(ids), seconds=round(seconds, 4), jobs_per_s=round(len(ids) / seconds, 3),
               output_tokens=tokens, prompt_tokens=queried, prefix_cache_hit_tokens=hits,
               prefix_cache_hit_rate=round(hits / queried, 4) if queried else 0.0,
               kernels_compiled_in_run=count_new(cached_kernels, triton_cache_entries()), gc=pauses.summary())
    if choices is not None:
        counts = Counter(r["text"] for r in results)
        off = {text: n for text, n in counts.items() if text not in choices}
        run["verdicts"] = {c: counts.get(c, 0) for c in choices}
        run["verdicts_not_in_choices"] = sum(off.values())
        run["verdicts_not_in_choices_examples"] = sorted(off, key=lambda t: -off[t])[:5]
    if log is not None:
        run["time_split"] = time_split(log, started_wall, last_stored)
        if sampler is not None:
            run["slow_first_calls"] = slow_call_stacks(sampler, log, thread.name)
    return run


def slow_call_stacks(sampler: StackSampler, log: StepLog, step_thread: str, first: int = 8) -> list[dict[str, Any]]:
    """For each of the first ``first`` calls of over 100 ms: the step loop's stacks and the busiest other threads'."""
    slow = []
    for i, ((seconds, *_), ended) in enumerate(zip(log.steps[:first], log.ended[:first])):
        if seconds > 0.1:
            slow.append(dict(call=i, ms=round(1e3 * seconds, 1),
                             step_loop=sampler.window(ended - seconds, ended, step_thread),
                             others=sampler.busiest(ended - seconds, ended, exclude=step_thread)))
    return slow


def slow_call_lines(slow: list[dict[str, Any]]) -> list[str]:
    lines = []
    for call in slow:
        lines.append(f"  call {call['call']} ({call['ms']:.0f} ms): step loop "
                     + _stack_text(call["step_loop"]))
        for other in call["others"]:
            lines.append(f"      {other['thread']}: " + _stack_text(other))
    return lines


def _stack_text(window: dict[str, Any]) -> str:
    if not window["stacks"]:
        return f"{window['samples']} samples"
    top = window["stacks"][0]
    return f"{window['samples']} samples, {100 * top['share']:.0f}% at " + " < ".join(top["frames"][:4])


def grading_roofline(llm: Any, jobs: GradingJobs, ceilings: Any, max_batch: int) -> dict[str, Any]:
    """The workload's bound with the rubric computed once (``bench.roofline.shared_prefix_bound``)."""
    from bench.roofline import ModelCounts, ceilings_dict, shared_prefix_bound

    config = llm.llm_engine.config
    gpus = config.parallel.tensor_parallel_size
    counts = ModelCounts.from_config(config.model.hf_config, dtype_bytes=config.model.dtype.itemsize,
                                     kv_dtype_bytes=config.kv_dtype.itemsize, tensor_parallel_size=gpus)
    bound = shared_prefix_bound(counts, ceilings.over(gpus), len(jobs.rubric), [len(s) for s in jobs.suffixes],
                                [jobs.verdict_tokens] * len(jobs.suffixes), max_batch,
                                config.scheduler.max_num_batched_tokens)
    return dict(**ceilings_dict(ceilings), gpus=gpus, **bound)


@click.command("grading")
@engine_options
@click.option("--num-jobs", "-n", type=int, default=1024, show_default=True)
@click.option("--rubric-len", type=int, default=1500, show_default=True, help="Tokens of the rubric every job shares.")
@click.option("--answer-len", type=int, default=200, show_default=True, help="Tokens of each job's own answer.")
@click.option("--instruction-len", type=int, default=16, show_default=True,
              help="Tokens of the verdict instruction after each answer.")
@click.option("--verdict-tokens", type=int, default=8, show_default=True, help="max_tokens of the verdict.")
@click.option("--verdict", type=click.Choice(["tokens", "choice"]), default="tokens", show_default=True,
              help="tokens: a plain greedy verdict; choice: constrained to --choices (structured outputs).")
@click.option("--choices", default="pass,fail", show_default=True, help="The verdicts --verdict choice allows.")
@click.option("--sample-stacks", is_flag=True,
              help="Sample the worker's thread stacks in its first seconds; report where its slow first calls went.")
@click.option("--offline", is_flag=True,
              help="Also run as many jobs (a fresh rubric) through the engine alone, without Redis or the worker.")
@click.option("--peer", type=click.Choice(["none", "hf"]), default="none", show_default=True,
              help="Also run HF transformers on the same jobs, in this process, before the engine.")
@click.option("--hf-modes", default="generate,generate_batch", show_default=True)
@click.option("--hf-batch-sizes", default="64,128,256", show_default=True)
@click.option("--roofline", is_flag=True, help="Measure the GPU's matmul rate and bandwidth; report the bound.")
@click.option("--appendonly/--no-appendonly", default=True, show_default=True,
              help="AOF persistence on the private Redis, as in production.")
@click.option("--worker-queues", default=None,
              help="The worker's --queues, comma-separated (the jobs go to bulk) [default: the worker's own].")
def grading_command(**opts: Any) -> None:
    """Grading jobs sharing one rubric, through Redis and a worker: jobs/s, prefix-cache hit rate,
    where the time went."""
    import torch

    from engine.models.loader import load_hf_config
    from worker.logs import configure

    hf_config = load_hf_config(opts["model"])
    choices = opts["choices"].split(",") if opts["verdict"] == "choice" else None
    if choices is not None and not all(choices):
        raise click.BadParameter(f"--choices must be non-empty verdicts separated by commas, got {opts['choices']!r}")
    if opts["worker_queues"] is not None and "bulk" not in opts["worker_queues"].split(","):
        raise click.BadParameter(f"--worker-queues must include bulk (the jobs' queue), got {opts['worker_queues']!r}")
    sampling = verdict_sampling(opts["verdict"], opts["verdict_tokens"], choices or [])
    opts["tokenizer"] = verdict_tokenizer(opts["model"], hf_config) if choices is not None else None
    jobs = make_jobs(opts["num_jobs"], opts["rubric_len"], opts["answer_len"], opts["instruction_len"],
                     opts["verdict_tokens"], hf_config.vocab_size, opts["seed"])
    workload = jobs.workload()
    result: dict[str, Any] = dict(workload="grading", env=environment(), workload_shape=workload.describe(),
                                  rubric_len=opts["rubric_len"], answer_len=opts["answer_len"],
                                  instruction_len=opts["instruction_len"], sampling=sampling,
                                  tokenizer=opts["tokenizer"], worker_queues=opts["worker_queues"],
                                  engine_args={k: opts[k] for k in ENGINE_KEYS})
    ceilings = None
    if opts["roofline"]:
        from bench.roofline import measure_ceilings

        ceilings = measure_ceilings()
    if opts["peer"] == "hf":
        from bench.hf_peer import run_peer

        sizes = [int(b) for b in opts["hf_batch_sizes"].split(",")]
        try:
            peer = run_peer(hf_config, getattr(torch, opts["dtype"]), workload.prompts, workload.output_lens,
                            opts["hf_modes"].split(","), sizes, opts["verdict_tokens"], min(sizes))
            if "elapsed_s" in peer:
                peer["jobs_per_s"] = round(peer["num_requests"] / peer["elapsed_s"], 3)
            result["peer"] = peer
        except Exception as err:  # noqa: BLE001 - the engine's numbers still count
            logger.exception("the HF peer failed")
            result["peer"] = dict(name="hf", error=f"{type(err).__name__}: {err}"[:500])
    llm, startup_s = build_llm(opts, workload)
    result["engine_startup_s"] = startup_s
    configure("WARNING")
    # NOTE: frozen for the offline run as the worker freezes it for its own (engine/gc_pauses.py)
    freeze_startup_heap()
    try:
        # warm-up outside the timing, on a rubric of its own so that the timed jobs find nothing cached
        warm = make_jobs(min(opts["num_jobs"], opts["max_num_seqs"]), opts["rubric_len"], opts["answer_len"],
                         opts["instruction_len"], opts["verdict_tokens"], hf_config.vocab_size, opts["seed"] + 1)
        run_through_worker(llm.llm_engine, opts["model"], warm, sampling, appendonly=False,
                           queues=opts["worker_queues"])
        run = run_through_worker(llm.llm_engine, opts["model"], jobs, sampling, opts["appendonly"], log=StepLog(),
                                 choices=choices, queues=opts["worker_queues"], sample_stacks=opts["sample_stacks"])
        result["engine"] = run
        offline = None
        if opts["offline"]:
            # NOTE: a rubric of its own again (seed + 2), so that it computes the rubric as the worker run did
            fresh = make_jobs(opts["num_jobs"], opts["rubric_len"], opts["answer_len"], opts["instruction_len"],
                              opts["verdict_tokens"], hf_config.vocab_size, opts["seed"] + 2)
            offline = result["offline"] = run_offline(llm, fresh.prompts, sampling)
        lines = [
            f"grading  {opts['model']} {opts['dtype']}  {run['jobs']} jobs x ({opts['rubric_len']} shared + "
            f"{opts['answer_len'] + opts['instruction_len']} own) in / {opts['verdict_tokens']} out, verdict "
            f"{opts['verdict']}" + (f", worker queues {opts['worker_queues']}" if opts["worker_queues"] else ""),
            f"  through the worker: {run['seconds']:.2f} s  {run['jobs_per_s']:.1f} jobs/s  prefix-cache hit rate "
            f"{run['prefix_cache_hit_rate']:.3f} of prompt tokens"
            + (f"; {run['kernels_compiled_in_run']} kernels compiled inside the timing"
               if run["kernels_compiled_in_run"] else ""),
            *split_lines(run["time_split"], "worker"),
            *gc_line(run.get("gc"), "worker"),
            *slow_call_lines(run.get("slow_first_calls", [])),
        ]
        if choices is not None:
            counts = ", ".join(f"{c} {n}" for c, n in run["verdicts"].items())
            line = f"  verdicts: {counts}; {run['verdicts_not_in_choices']} not one of the choices (0 expected)"
            if run["verdicts_not_in_choices"]:
                line += f", e.g. {run['verdicts_not_in_choices_examples'][:3]}"
            lines.append(line)
        if offline is not None:
            lines.append(f"  offline (the engine alone, a fresh rubric): {offline['seconds']:.2f} s  "
                         f"{offline['jobs_per_s']:.1f} jobs/s  prefix-cache hit rate "
                         f"{offline['prefix_cache_hit_rate']:.3f}")
            lines.extend(split_lines(offline["time_split"], "offline"))
            lines.extend(gc_line(offline.get("gc"), "offline"))
        peer = result.get("peer")
        if peer and "jobs_per_s" in peer:
            result["ratio_vs_peer"] = run["jobs_per_s"] / peer["jobs_per_s"]
            lines.append(f"  hf ({peer['best_mode']}, batch {peer['batch_size']}): {peer['jobs_per_s']:.1f} jobs/s "
                         f"-> engine is {result['ratio_vs_peer']:.2f}x")
        roof = None
        if ceilings is not None:
            roof = grading_roofline(llm, jobs, ceilings, opts["max_num_seqs"])
            roof["fraction"] = roof["bound_s"] / run["seconds"]
            if offline is not None:
                roof["offline_fraction"] = roof["bound_s"] / offline["seconds"]
            result["roofline"] = roof
            lines.append(f"  roofline (rubric computed once): bound {roof['bound_s']:.3f} s (prefill "
                         f"{roof['prefill_bound_s']:.3f}, decode {roof['decode_bound_s']:.3f}) -> "
                         f"{100 * roof['fraction']:.0f}% ({roof['matmul_tflops']:.0f} TFLOP/s, "
                         f"{roof['bandwidth_gbs']:.0f} GB/s measured)")
            lines.extend(roofline_lines(roof, run, offline))
        result["gap"] = gap(run["seconds"], offline["seconds"] if offline else None, roof["bound_s"] if roof else None)
        lines.extend(gap_lines(result["gap"]))
    finally:
        llm.shutdown()
        thaw_startup_heap()
    emit(result, lines, opts["json_path"])
