"""``sluiceway bench worker``: throughput through Redis and the worker against the offline engine.

One engine is built once and used twice on the same workload: first offline (every request
added, then ``step()`` until done, as ``LLM.generate`` does), then through a private
redis-server -- all jobs submitted with the producer client first, then a worker started in
this process on the same engine, timed from its start to the last result stored. Prints a
human summary and, with ``--json``, the same numbers as JSON. The target is
``e2e_over_offline >= 0.95`` on the throughput workload.

    python -m bench worker --model llama3-8b --load-format dummy --num-requests 1024 \\
        --input-len 512 --output-len 256 --json bench-worker.json
"""

from __future__ import annotations

import json
import platform
import random
import threading
import time
from typing import Any

import click

from bench.common import print_report


def make_prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(n)]


def run_offline(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}", prompt, params, final_only=True)  # as LLM.generate does
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
    return _rates(len(prompts), tokens, time.perf_counter() - started)


def run_worker(engine: Any, model: str, prompts: list[list[int]], output_len: int, appendonly: bool) -> dict[str, float]:
    from producers.client import Client
    from worker.embedded_redis import EmbeddedRedis
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    sampling = {"temperature": 0.0, "max_tokens": output_len, "ignore_eos": True}
    with EmbeddedRedis(appendonly=appendonly) as server, Client(server.url, queue="bulk", socket_timeout=600) as client:
        ids = client.submit_many({"prompt_token_ids": p, "sampling": sampling} for p in prompts)
        settings = WorkerSettings(model=model, redis=server.url, name="bench", swap_space="4", log_level="WARNING")
        worker = Worker(settings, engine=engine)
        thread = threading.Thread(target=worker.work, name="sluiceway-bench-worker", daemon=True)
        started_wall, started = time.time(), time.perf_counter()
        thread.start()
        for job_id in ids:  # NOTE: only the done signals while timing: the bench must not compete for the GIL
            done = client.keys.done(job_id)
            while client.redis.blmove(done, done, 60, "RIGHT", "LEFT") is None:
                if not thread.is_alive():
                    raise RuntimeError("the worker stopped before every job ended")
        seen = time.perf_counter() - started
        worker.request_stop()
        thread.join(60)
        with client.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(client.keys.job(job_id), ["status", "finished_at", "result"])
            rows = pipe.execute()
    bad = [status for status, _, _ in rows if status != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs did not end done: {sorted(set(bad))}")
    last_stored = max(float(finished_at) for _, finished_at, _ in rows)  # the worker's clock: no polling lag
    tokens = sum(json.loads(result)["usage"]["completion_tokens"] for _, _, result in rows)
    rates = _rates(len(prompts), tokens, max(1e-9, last_stored - started_wall))
    rates["seconds_until_client_saw_all"] = round(seen, 4)
    return rates


def _rates(n: int, tokens: int, seconds: float) -> dict[str, float]:
    return {"requests": n, "output_tokens": tokens, "seconds": round(seconds, 4),
            "output_tok_s": round(tokens / seconds, 2), "requests_per_s": round(n / seconds, 2)}


def compare(engine: Any, model: str, n: int, input_len: int, output_len: int, seed: int, appendonly: bool) -> dict:
    """Offline, then through the worker, then offline again, each on fresh prompts of one shape.

    NOTE: the engine's own speed drifts between back-to-back runs on one GPU (measured on an
    H200: the second of two identical offline runs 5% slower), so the worker is compared with
    the mean of the offline runs that bracket it, and with each of them.
    """
    run_offline(engine, make_prompts(min(n, 64), input_len, engine.vocab_size, seed + 3), output_len)  # warm-up
    before = run_offline(engine, make_prompts(n, input_len, engine.vocab_size, seed), output_len)
    through = run_worker(engine, model, make_prompts(n, input_len, engine.vocab_size, seed + 1), output_len,
                         appendonly)
    after = run_offline(engine, make_prompts(n, input_len, engine.vocab_size, seed + 2), output_len)
    offline_mean = (before["output_tok_s"] + after["output_tok_s"]) / 2
    return {"workload": {"requests": n, "input_len": input_len, "output_len": output_len},
            "offline": before, "worker": through, "offline_after": after,
            "e2e_over_offline": round(through["output_tok_s"] / offline_mean, 4),
            "e2e_over_offline_before": round(through["output_tok_s"] / before["output_tok_s"], 4),
            "e2e_over_offline_after": round(through["output_tok_s"] / after["output_tok_s"], 4),
            "jobs_per_s": through["requests_per_s"]}


def _environment(engine: Any) -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
    return env


@click.command("bench-worker")
@click.option("--model", default="llama3-8b", show_default=True, help="A model folder or a preset name (with --load-format dummy).")
@click.option("--load-format", default="dummy", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--max-model-len", type=int, default=None)
@click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True)
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE", help="Any other EngineArgs field (VALUE as JSON when it parses).")
@click.option("--num-requests", type=int, default=1024, show_default=True)
@click.option("--input-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--short-requests", type=int, default=4096, show_default=True, help="Short grading jobs for jobs/s (0: skip).")
@click.option("--short-input-len", type=int, default=128, show_default=True)
@click.option("--short-output-len", type=int, default=4, show_default=True)
@click.option("--appendonly/--no-appendonly", default=True, show_default=True, help="AOF persistence on the private Redis, as in production.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the results here.")
def worker_command(model, load_format, device, dtype, tensor_parallel_size, max_num_seqs, max_model_len,
                  gpu_memory_utilization, engine_args, num_requests, input_len, output_len, short_requests,
                  short_input_len, short_output_len, appendonly, seed, json_path) -> None:
    """Throughput of the same jobs offline and through Redis + the worker; prints the ratio."""
    from engine import EngineArgs, LLMEngine
    from worker.logs import configure

    configure("WARNING")
    kwargs: dict[str, Any] = dict(model=model, load_format=load_format, device=device, dtype=dtype,
                                  tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                  seed=seed)
    for item in engine_args:
        key, _, value = item.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except ValueError:
            kwargs[key] = value
    engine = LLMEngine(EngineArgs(**kwargs))
    try:
        run_offline(engine, make_prompts(min(num_requests, 2 * max_num_seqs), 16, engine.vocab_size, seed + 1), 8)  # warm-up
        report: dict[str, Any] = {"engine_args": {k: v for k, v in kwargs.items() if v is not None},
                                  "environment": _environment(engine)}
        report["throughput"] = compare(engine, model, num_requests, input_len, output_len, seed, appendonly)
        if short_requests:
            report["short"] = compare(engine, model, short_requests, short_input_len, short_output_len, seed, appendonly)
    finally:
        engine.shutdown()
    for name in ("throughput", "short"):
        if name in report:
            r = report[name]
            click.echo(f"{name}: offline {r['offline']['output_tok_s']:.1f} / {r['offline_after']['output_tok_s']:.1f} "
                       f"tok/s (before / after), through the worker {r['worker']['output_tok_s']:.1f} tok/s, "
                       f"e2e/offline {r['e2e_over_offline']:.3f} (vs before {r['e2e_over_offline_before']:.3f}, "
                       f"after {r['e2e_over_offline_after']:.3f}), "
                       f"{r['jobs_per_s']:.1f} jobs/s ({r['workload']})")
    print_report(report, json_path)


if __name__ == "__main__":
    worker_command()
