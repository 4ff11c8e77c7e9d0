"""``sluiceway bench stream-writes``: what a streamed token costs the worker and Redis (CPU is enough).

``--jobs`` streamed jobs of ``--output-len`` tokens, submitted before the clock starts, run by
a worker (a thread of this process) on the bench-only instant engine at one token a step, a
step every ``--step-ms`` (a GPU's cadence: the writer keeps up, so every step of every job is
written), ``--max-num-seqs`` at a time, against a private redis-server. No gateway and no
readers: only the worker's writes. Reports the worker's CPU per token (the whole process, its
step loop and its writer threads), Redis's CPU per token and the script calls (``EVALSHA``)
and stream entries (``XADD``) per token, as ``INFO commandstats`` counted them.

    sluiceway bench stream-writes --jobs 1024 --output-len 64 --max-num-seqs 256 --step-ms 20
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

import click

from bench.common import print_report

LOOP_THREAD = "sluiceway-bench-stream-writes"


def _thread_cpu(names: set[str]) -> dict[str, float]:
    """CPU seconds of this process's live threads named ``names`` so far (psutil: empty without it)."""
    try:
        import psutil
    except ImportError:
        return {}
    by_id = {t.native_id: t.name for t in threading.enumerate() if t.name in names}
    return {by_id[t.id]: round(t.user_time + t.system_time, 3) for t in psutil.Process().threads() if t.id in by_id}


def run_stream_writes(jobs: int, output_len: int, max_num_seqs: int, step_ms: float) -> dict[str, Any]:
    import redis

    from bench.instant_engine import InstantEngine
    from producers.client import Client
    from producers.embedded_redis import EmbeddedRedis
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    with EmbeddedRedis() as server, Client(server.url, socket_timeout=300) as client, \
            redis.Redis.from_url(server.url) as r:
        ids = client.submit_many([{"prompt_token_ids": [10, 11, 12], "stream": True,
                                   "sampling": {"max_tokens": output_len, "ignore_eos": True}}] * jobs)
        r.config_resetstat()
        settings = WorkerSettings(model="instant", served_model_name="bench", redis=server.url, name="stream-writes",
                                  swap_space="0", log_level="WARNING", celery=False)
        worker = Worker(settings, engine=InstantEngine(max_num_seqs=max_num_seqs, tokens_per_step=1,
                                                       step_s=step_ms / 1000))
        thread = threading.Thread(target=worker.work, name=LOOP_THREAD, daemon=True)
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        thread.start()
        try:
            for job_id in ids:  # NOTE: a BLPOP each: this thread spends next to nothing
                client.result(job_id, timeout=300)
            seconds = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_SELF)
            threads = _thread_cpu({LOOP_THREAD, "sluiceway-writer"})
            stats, cpu = r.info("commandstats"), r.info("cpu")
        finally:
            worker.request_stop()
            thread.join(60)
    tokens = jobs * output_len
    process = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    calls = {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "xadd")}
    redis_cpu = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    return {"workload": {"jobs": jobs, "output_len": output_len, "max_num_seqs": max_num_seqs, "step_ms": step_ms,
                         "engine": "instant (bench/instant_engine.py), one token a step"},
            "tokens": tokens, "seconds": round(seconds, 3),
            "worker_cpu_us_per_token": round(1e6 * process / tokens, 2),
            "thread_cpu_us_per_token": {name: round(1e6 * s / tokens, 2) for name, s in threads.items()},
            "redis_cpu_us_per_token": round(1e6 * redis_cpu / tokens, 2),
            "evalsha_per_token": round(calls["evalsha"] / tokens, 4), "xadd_per_token": round(calls["xadd"] / tokens, 4),
            "redis_calls": calls}


@click.command("stream-writes")
@click.option("--jobs", type=int, default=1024, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--step-ms", type=float, default=20.0, show_default=True, help="the instant engine's step time")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the results here.")
def stream_writes_command(jobs, output_len, max_num_seqs, step_ms, json_path) -> None:
    """The worker's and Redis's cost per streamed token, on the instant engine."""
    from worker.logs import configure

    configure("WARNING")
    report = run_stream_writes(jobs, output_len, max_num_seqs, step_ms)
    click.echo(f"stream-writes: worker {report['worker_cpu_us_per_token']} us CPU a token "
               f"(threads {report['thread_cpu_us_per_token']}), Redis {report['redis_cpu_us_per_token']} us, "
               f"{report['evalsha_per_token']} EVALSHA and {report['xadd_per_token']} XADD a token "
               f"({report['workload']})")
    print_report(report, json_path)
