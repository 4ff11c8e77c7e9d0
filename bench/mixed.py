"""``sluiceway bench mixed``: interactive jobs arriving while a bulk backlog fills the KV cache.

Through a private redis-server and a real worker in this process (as ``bench worker``): a
backlog of ``--bulk-requests`` long-context jobs on queue ``bulk`` (4,096 in / 256 out by
default) that fills the KV cache, and interactive jobs on queue ``interactive`` arriving as
a Poisson process (``--interactive-rate`` per second, 256 in / 64 out) until the backlog is
done. Each scheduling mode runs the same traffic (the same arrival times, fresh prompts) on the
same engine:

- ``fcfs``: ``scheduling_policy=fcfs``: no preemption for rank (an interactive job waits for
  a seat and blocks like any other);
- ``swap``: ``scheduling_policy=priority``, victims of rank preemption swapped out;
- ``recompute``: the same, victims recomputed.

Baselines: interactive TTFT on an idle engine (``--idle-requests`` jobs one at a time), and
bulk output tok/s of the backlog alone (per preemption mode: swap, recompute). Reported per
mode: interactive TTFT (enqueued -> first token) p50/p99 and per-token latency, bulk output
tok/s and its ratio to the backlog alone, preemptions (for rank and all), swap GB moved,
where swap time went, and the swap pool's size over time (it follows the backlog under
``--swap-space auto``). One engine serves every mode, switched between runs, so all share
one start-up and one warm-up.

    sluiceway bench mixed --json mixed.json
    sluiceway bench mixed --modes swap --bulk-requests 64 --interactive-rate 1
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import click

from bench.common import emit, environment
from bench.mixed_report import lines, stalls, summarize_phase
from bench.stack_sampler import StackSampler

# the worker's step loop runs in this thread (named so the stack sampler, which samples
# threads whose names start with "sluiceway", sees it)
STEP_LOOP_THREAD = "sluiceway-step-loop-{name}"

# where the step loop's time goes (--sample-stacks): the innermost of these on its stack
STEP_LOOP_PARTS = ("admit_new_jobs", "_launch_express", "_express_beside", "wait", "schedule", "prepare", "execute",
                   "_sample", "_postprocess", "publish_step", "finish", "checkpoint_progress", "housekeeping",
                   "apply_cancels_and_deadlines", "step_engine")

MODES: dict[str, dict[str, Any]] = {
    "fcfs": dict(scheduling_policy="fcfs", preemption_mode="swap"),
    "swap": dict(scheduling_policy="priority", preemption_mode="swap"),
    "recompute": dict(scheduling_policy="priority", preemption_mode="recompute"),
    "express": dict(scheduling_policy="priority", preemption_mode="swap"),  # with the lane (--express-lane-tokens)
}


@click.command("mixed")
@click.option("--model", default="llama3-8b", show_default=True, help="A preset (dummy weights) or a model folder.")
@click.option("--load-format", default="dummy", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--gpu-memory-utilization", type=float, default=0.30, show_default=True,
              help="Small, so that the backlog fills the KV cache.")
@click.option("--num-gpu-blocks", type=int, default=None, help="Fix the KV cache size instead (CPU checks).")
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Off: a victim preempted by recompute computes its whole prompt again (on, its freed "
                   "blocks may still be cached when it comes back).")
@click.option("--prefill-graph-tokens", type=int, default=None,
              help="Prompt-carrying steps of up to this many tokens replay CUDA graphs; 0: eager [default: the engine's, 512].")
@click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
              help="Launch each step before the previous one's tokens are read back (then an arrival also "
                   "waits out the step queued behind the one in flight).")
@click.option("--late-admission", is_flag=True,
              help="The worker admits jobs just before each step is scheduled, once the step in flight has ended "
                   "(an arrival joins the next step, not the one after; the GPU idles while a step launches).")
@click.option("--express-lane-tokens", type=int, default=512, show_default=True,
              help="The express mode's lane: interactive prompts of up to this many tokens run beside the step in "
                   "flight (implies late admission in that mode).")
@click.option("--bulk-requests", type=int, default=128, show_default=True)
@click.option("--bulk-input-len", type=int, default=4096, show_default=True)
@click.option("--bulk-output-len", type=int, default=256, show_default=True)
@click.option("--interactive-rate", type=float, default=2.0, show_default=True, help="Arrivals per second (Poisson).")
@click.option("--interactive-input-len", type=int, default=256, show_default=True)
@click.option("--interactive-output-len", type=int, default=64, show_default=True)
@click.option("--idle-requests", type=int, default=8, show_default=True, help="Interactive jobs on an idle engine.")
@click.option("--swap-space", default="auto", show_default=True, help="GiB per GPU, or 'auto' (the worker sizes it).")
@click.option("--swap-floor-gib", type=float, default=1.0, show_default=True)
@click.option("--swap-cap-gib", type=float, default=None, help="Default: the worker's (a quarter of host memory).")
@click.option("--shrink-after-s", type=float, default=5.0, show_default=True,
              help="Under auto: how long the pool waits to shrink (the worker's is 30 s; shorter here to see it).")
@click.option("--linger-s", type=float, default=None,
              help="Seconds to keep sampling after the backlog drains (default: under auto, long enough to shrink).")
@click.option("--modes", default="fcfs,swap,recompute", show_default=True,
              help="Comma-separated: fcfs, swap, recompute, express; a mode named again runs again (mode#2).")
@click.option("--sample-s", type=float, default=0.5, show_default=True, help="Swap pool sampling interval.")
@click.option("--sample-stacks", is_flag=True,
              help="Sample the worker's threads' stacks through each run with interactive jobs and report, for "
                   "the slowest jobs' long stages, where the step loop sat and which other thread was busy.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the result as JSON here ('-' for stdout).")
def mixed_command(**opts: Any) -> None:
    """Interactive TTFT and bulk tok/s with a bulk backlog filling the cache: fcfs vs swap vs recompute."""
    from worker.logs import configure

    modes = [m.strip() for m in opts["modes"].split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if not modes or unknown:
        raise click.BadParameter(f"--modes: unknown {', '.join(unknown) or '(none given)'}; choose from "
                                 f"{', '.join(MODES)}")
    configure("WARNING")
    lane = opts["express_lane_tokens"] if "express" in modes else 0
    settings = {m: {**MODES[m], "express_lane_tokens": lane if m == "express" else 0} for m in modes}
    # NOTE: an engine with the lane's graphs (one engine serves every mode); the modes without it turn it off
    engine = build_engine(opts, {**settings[modes[0]], "scheduling_policy": "priority", "express_lane_tokens": lane})
    result: dict[str, Any] = dict(workload="mixed", env=environment(), options=dict(opts),
                                  num_gpu_blocks=engine.block_manager.gpu.num_blocks, runs={})
    try:
        bench = MixedBench(engine, opts)
        bench.warm_up()
        set_mode(engine, settings[modes[0]])
        result["idle"] = bench.idle_ttft()
        result["bulk_alone"] = {}
        for mode, name in zip(modes, run_names(modes)):
            preemption = MODES[mode]["preemption_mode"]
            set_mode(engine, settings[mode])
            if preemption not in result["bulk_alone"]:
                click.echo(f"# mixed bench: bulk alone ({preemption})", err=True)
                result["bulk_alone"][preemption] = bench.phase(f"alone-{preemption}", interactive=False)
            click.echo(f"# mixed bench: {name}", err=True)
            run = result["runs"][name] = bench.phase(name, interactive=True)
            alone = result["bulk_alone"][preemption]["bulk"]["output_tok_s"]
            run["bulk_vs_alone"] = run["bulk"]["output_tok_s"] / alone if alone else None
            idle = result["idle"]["ttft_p50_s"]
            run["ttft_p99_vs_idle"] = run["interactive"]["ttft_p99_s"] / idle if idle else None
    finally:
        engine.shutdown()
    emit(result, lines(result), opts["json_path"])


def run_names(modes: list[str]) -> list[str]:
    """A name per run: the mode, then ``mode#2``, ``mode#3`` for its repeats (``--modes swap,recompute,swap,recompute``)."""
    counts = [modes[: i + 1].count(mode) for i, mode in enumerate(modes)]
    return [mode if n == 1 else f"{mode}#{n}" for mode, n in zip(modes, counts)]


def build_engine(opts: dict[str, Any], mode: dict[str, str]):
    from engine import EngineArgs, LLMEngine

    swap = opts["swap_floor_gib"] if opts["swap_space"] == "auto" else float(opts["swap_space"])
    longest = max(opts["bulk_input_len"] + opts["bulk_output_len"],
                  opts["interactive_input_len"] + opts["interactive_output_len"])
    return LLMEngine(EngineArgs(
        model=opts["model"], load_format=opts["load_format"], device=opts["device"], dtype=opts["dtype"],
        gpu_memory_utilization=opts["gpu_memory_utilization"], num_gpu_blocks_override=opts["num_gpu_blocks"],
        max_num_seqs=opts["max_num_seqs"], max_num_batched_tokens=opts["max_num_batched_tokens"],
        block_size=opts["block_size"], enforce_eager=opts["enforce_eager"], max_model_len=longest,
        enable_prefix_caching=opts["enable_prefix_caching"],
        prefill_graph_tokens=opts["prefill_graph_tokens"], async_scheduling=opts["async_scheduling"],
        swap_space=swap, seed=opts["seed"], **mode))


def set_mode(engine: Any, mode: dict[str, str]) -> None:
    """Give the idle engine a scheduler of another policy and preemption mode.

    NOTE: bench-only: every mode then runs on one engine (one start-up, one warm-up, the same
    GPU state); the block manager, and so the cache and swap pool, carry over empty.
    """
    from engine.core.scheduler import Scheduler

    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle to change its scheduling mode")
    config = engine.config.scheduler = dataclasses.replace(engine.config.scheduler, **mode)
    engine.scheduler = Scheduler(config, engine.block_manager, engine.scheduler.cost_model)


def arrival_offsets(rate: float, seed: int) -> Iterator[float]:
    """Seconds from a phase's start of its interactive arrivals: a Poisson process of ``rate``.

    NOTE: a generator of its own, seeded alike, so every mode meets the same arrival times (two
    runs with draws of their own once differed by 16 of ~80 jobs, 22% of the interactive work)."""
    gaps = random.Random(seed)
    at = 0.0
    while True:
        at += gaps.expovariate(rate)
        yield at


class MixedBench:
    """The phases, on one engine and one private redis-server."""

    def __init__(self, engine: Any, opts: dict[str, Any]) -> None:
        self.engine = engine
        self.opts = opts
        self.rng = random.Random(opts["seed"])
        self.vocab = engine.vocab_size

    def prompts(self, n: int, length: int) -> list[list[int]]:
        """Fresh random prompts: no run hits another's prefix cache."""
        return [[self.rng.randrange(10, self.vocab) for _ in range(length)] for _ in range(n)]

    def warm_up(self) -> None:
        from engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, prompt in enumerate(self.prompts(4, self.opts["interactive_input_len"])):
            self.engine.add_request(f"warm-{i}", prompt, params, final_only=True)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def idle_ttft(self) -> dict[str, Any]:
        """Interactive jobs one at a time on an otherwise idle worker."""
        o = self.opts
        with self.running_worker("idle") as (client, _):
            ids = []
            for prompt in self.prompts(o["idle_requests"], o["interactive_input_len"]):
                ids.append(client.submit(prompt_token_ids=prompt, sampling=self.sampling(o["interactive_output_len"]),
                                         queue="interactive"))
                client.result(ids[-1], timeout=600)
            rows = fetch(client, ids)
        return summarize_phase(rows, [], [], 0.0, {}, {})["interactive"]

    def phase(self, name: str, interactive: bool) -> dict[str, Any]:
        """The bulk backlog, with interactive arrivals until it is done (or without)."""
        o = self.opts
        bulk_prompts = self.prompts(o["bulk_requests"], o["bulk_input_len"])
        before = dataclasses.asdict(self.engine.get_stats())
        counters_before = _swap_counters(self.engine)
        steps: list = []  # every step() call's record (engine.observer.StepRecord), for the step times
        self.engine.add_step_observer(steps.append)
        sampler = None  # --sample-stacks: the worker's threads through the run, for the slowest jobs' stalls
        if interactive and o["sample_stacks"]:
            sampler = StackSampler(interval_s=0.005, duration_s=3600.0, depth=32).start()
        with self.running_worker(name) as (client, samples):
            if not self.alive():
                raise RuntimeError("the worker stopped at start-up")
            started = time.time()
            bulk = client.submit_many(({"prompt_token_ids": p, "sampling": self.sampling(o["bulk_output_len"])}
                                       for p in bulk_prompts), queue="bulk")
            bulk_done = threading.Event()
            waiter = threading.Thread(target=wait_all, args=(client, bulk, bulk_done, self.alive), daemon=True)
            waiter.start()
            urgent = self.arrivals(client, bulk_done) if interactive else []
            waiter.join()
            drained = time.time()
            for job_id in urgent:
                client.result(job_id, timeout=600)
            self.linger(samples)
            bulk_rows, urgent_rows = fetch(client, bulk), fetch(client, urgent)
        if sampler is not None:
            sampler.stop()
        self.engine.remove_step_observer(steps.append)
        after = dataclasses.asdict(self.engine.get_stats())
        stats = {k: after[k] - before[k] for k in after if isinstance(after[k], int) and not k.startswith("num_free")
                 and k not in ("num_gpu_blocks", "num_cpu_blocks", "swap_pool_bytes", "swap_pool_resident_bytes",
                               "num_running", "num_waiting", "num_swapped")}
        swap_time = {k: v - counters_before.get(k, 0) for k, v in _swap_counters(self.engine).items()}
        sizer = self._running.worker.swap  # None: a fixed pool, never resized
        # what resizing the pool cost the step loop, which it stalls
        swap_time.update(resizes=sizer.num_resizes if sizer else 0,
                         resize_s_total=round(sizer.resize_s_total, 4) if sizer else 0.0,
                         resize_s_max=round(sizer.resize_s_max, 4) if sizer else 0.0)
        summary = summarize_phase(urgent_rows, bulk_rows, samples, started, stats, swap_time, steps)
        if sampler is not None:
            summary["stalls"] = stalls(urgent_rows, sampler, STEP_LOOP_THREAD.format(name=name))
            # NOTE: while the backlog ran: the share of the step loop's samples in each part
            summary["step_loop"] = sampler.shares(STEP_LOOP_THREAD.format(name=name), started, drained,
                                                  STEP_LOOP_PARTS)
        return summary

    def arrivals(self, client: Any, bulk_done: threading.Event) -> list[str]:
        """Submit interactive jobs at Poisson times until the backlog is done; return their ids."""
        o = self.opts
        ids: list[str] = []
        start = time.monotonic()
        for offset in arrival_offsets(o["interactive_rate"], o["seed"]):
            if bulk_done.wait(max(0.0, start + offset - time.monotonic())):
                break
            prompt = self.prompts(1, o["interactive_input_len"])[0]
            ids.append(client.submit(prompt_token_ids=prompt, sampling=self.sampling(o["interactive_output_len"]),
                                     queue="interactive"))
        return ids

    def linger(self, samples: list[dict[str, float]]) -> None:
        """Keep the worker (and the sampler) running after the backlog, so the pool can shrink."""
        o = self.opts
        linger = o["linger_s"]
        if linger is None:
            linger = o["shrink_after_s"] + 3.0 if o["swap_space"] == "auto" else 0.0
        time.sleep(linger)  # NOTE: a measurement window, not a wait for a condition

    @staticmethod
    def sampling(max_tokens: int) -> dict[str, Any]:
        return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}

    def running_worker(self, name: str):
        self._running = _RunningWorker(self.engine, self.opts, name)
        return self._running

    def alive(self) -> bool:
        return self._running.thread.is_alive()


class _RunningWorker:
    """A private redis-server, a client, the worker in a thread and the swap-pool sampler."""

    def __init__(self, engine: Any, opts: dict[str, Any], name: str) -> None:
        self.engine, self.opts, self.name = engine, opts, name
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()

    def __enter__(self):
        from producers.client import Client
        from worker.embedded_redis import EmbeddedRedis
        from worker.loop import Worker
        from worker.settings import WorkerSettings

        o = self.opts
        self.server = EmbeddedRedis().__enter__()
        self.client = Client(self.server.url, socket_timeout=600).__enter__()
        lane = bool(self.engine.config.scheduler.express_lane_tokens)  # NOTE: the lane runs in late admission's wait
        settings = WorkerSettings(model=o["model"], redis=self.server.url, name=f"bench-{self.name}",
                                  swap_space=o["swap_space"], swap_floor_gib=o["swap_floor_gib"],
                                  swap_cap_gib=o["swap_cap_gib"], log_level="WARNING", celery=False,
                                  late_admission=o["late_admission"] or lane)
        self.worker = Worker(settings, engine=self.engine)
        if self.worker.swap is not None:
            self.worker.swap.shrink_after_s = o["shrink_after_s"]
        self.thread = threading.Thread(target=self.worker.work, name=STEP_LOOP_THREAD.format(name=self.name),
                                       daemon=True)
        self.sampler = threading.Thread(target=self._sample, name="sluiceway-bench-swap-sampler", daemon=True)
        self.thread.start()
        self.sampler.start()
        return self.client, self.samples

    def _sample(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.opts["sample_s"]):
            try:
                s = self.engine.get_stats()  # NOTE: reads counters only; the step loop's thread owns the engine
            except Exception:  # a read racing a resize: skip this sample
                continue
            self.samples.append(dict(t=round(time.monotonic() - started, 2), pool_bytes=s.swap_pool_bytes,
                                     resident_bytes=s.swap_pool_resident_bytes, running=s.num_running,
                                     waiting=s.num_waiting, swapped=s.num_swapped))

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.worker.request_stop()
        self.thread.join(120)
        self.sampler.join(10)
        self.client.__exit__(*exc)
        self.server.__exit__(*exc)


def wait_all(client: Any, ids: list[str], done: threading.Event, alive) -> None:
    """Set ``done`` once every job has ended (or the worker has stopped)."""
    try:
        for job_id in ids:
            key = client.keys.done(job_id)
            while client.redis.blmove(key, key, 5, "RIGHT", "LEFT") is None:
                if not alive():
                    return
    finally:
        done.set()


def fetch(client: Any, ids: list[str]) -> list[dict[str, Any]]:
    """Each job's status, end time and result, as the worker stored them."""
    import json

    with client.redis.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(client.keys.job(job_id), ["status", "finished_at", "result"])
        rows = pipe.execute()
    return [dict(id=job_id, status=status, finished_at=float(finished or 0),
                 result=json.loads(result) if result else None)
            for job_id, (status, finished, result) in zip(ids, rows)]


def _swap_counters(engine: Any) -> dict[str, float]:
    cache = getattr(getattr(engine.executor, "runner", None), "cache", None)
    if cache is None:
        return {}
    cache.synchronize()
    return dataclasses.asdict(cache.counters)


if __name__ == "__main__":
    mixed_command()
