"""``sluiceway bench gateway``: what the OpenAI gateway adds, in latency and in throughput.

``--mode latency`` (CPU is enough): a worker on the bench-only ``InstantEngine`` (every token
at once), one request at a time, first submitted through ``Client`` directly, then as an
OpenAI request through a gateway process (whole, then streamed); p50 / p99 of each and what
the gateway adds.

``--mode streams`` (CPU is enough): streaming capacity: ``--num-requests`` streamed requests
of ``--output-len`` tokens, ``--concurrency`` at once, from a separate load process through
``--gateway-workers`` gateway processes to a worker on the instant engine at one token per
step (``--max-num-seqs`` at a time): streamed tok/s through the gateway, and the Redis
commands the gateways sent per streamed token (``XREAD``: the token streams' reads).

``--mode throughput``: the throughput workload (``bench/throughput.py``'s requests: random
token prompts, ``ignore_eos``) on one real engine, offline, then as concurrent OpenAI
requests (``--concurrency``, default all 1,024 at once) from a separate load process through
a gateway process to a worker on the same engine, then offline again; output tok/s of each
and ``gateway_over_offline`` (the target is >= 0.95).

    sluiceway bench gateway --mode latency --requests 300
    sluiceway bench gateway --mode streams --num-requests 512 --output-len 64 --concurrency 512
    sluiceway bench gateway --mode throughput --model llama3-8b --num-requests 1024 --json gw.json
"""

from __future__ import annotations

import contextlib
import logging
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import click

from bench.common import print_report

MODEL_NAME = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(1000 * percentile(values, 0.5), 3), "p99_ms": round(1000 * percentile(values, 0.99), 3),
            "mean_ms": round(1000 * sum(values) / len(values), 3), "n": len(values)}


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds spent so far by process ``pid`` and its children (None without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        process = psutil.Process(pid)
        return round(sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)]), 2)
    except psutil.Error:
        return None


@contextlib.contextmanager
def serving(engine: Any, redis_url: str, model: str, max_connections: int = 4096, processes: int = 1,
            cpu_seconds: dict[str, Any] | None = None) -> Iterator[str]:
    """A worker (a thread of this process, on ``engine``) and a gateway process; yields the gateway's
    URL; ``cpu_seconds["gateway"]``: the CPU seconds its processes spent, when it ends."""
    cpu_seconds = {} if cpu_seconds is None else cpu_seconds
    import httpx

    from producers.embedded_redis import free_port
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    settings = WorkerSettings(model=model, served_model_name=MODEL_NAME, redis=redis_url, name="bench-gateway",
                              swap_space="0", log_level="WARNING", celery=False)
    worker = Worker(settings, engine=engine)
    thread = threading.Thread(target=worker.work, name="sluiceway-bench-worker", daemon=True)
    thread.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "--redis", redis_url, "--port", str(port),
                                "--log-level", "WARNING", "--models-refresh-seconds", "1",
                                "--redis-max-connections", str(max_connections), "--workers", str(processes)])
    try:
        deadline = time.monotonic() + 120
        while True:  # NOTE: the gateway offers no readiness signal but answering
            try:
                models = httpx.get(url + "/v1/models", timeout=2).json()["data"]
                if any(m["id"] == MODEL_NAME for m in models):
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if gateway.poll() is not None or not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway or the worker did not come up")
            time.sleep(0.1)
        yield url
    finally:
        cpu_seconds["gateway"] = _cpu_seconds(gateway.pid)
        gateway.terminate()
        try:  # NOTE: longer than the gateway's own bound on a graceful stop (30 s, gateway/cli.py)
            gateway.wait(45)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait(10)
        worker.request_stop()
        thread.join(60)


def run_latency(requests: int, input_len: int, max_tokens: int, seed: int) -> dict[str, Any]:
    import random

    import httpx

    from bench.instant_engine import InstantEngine
    from producers.client import Client
    from producers.embedded_redis import EmbeddedRedis

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 30000) for _ in range(input_len)] for _ in range(requests)]
    sampling = {"max_tokens": max_tokens, "temperature": 0}
    with EmbeddedRedis() as server, serving(InstantEngine(), server.url, "instant") as url, \
            Client(server.url, socket_timeout=60) as client, httpx.Client(base_url=url, timeout=60) as http:
        def direct(prompt: list[int]) -> None:
            client.result(client.submit(prompt_token_ids=prompt, sampling=sampling), timeout=60)

        def whole(prompt: list[int]) -> None:
            reply = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, **sampling})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == max_tokens

        def streamed(prompt: list[int]) -> None:
            body = {"model": MODEL_NAME, "prompt": prompt, "stream": True, **sampling}
            with http.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200 and reply.read().endswith(b"data: [DONE]\n\n")

        timings: dict[str, list[float]] = {}
        for name, call in (("direct", direct), ("gateway", whole), ("gateway_stream", streamed)):
            for prompt in prompts[: max(5, requests // 10)]:  # warm-up
                call(prompt)
            times = []
            for prompt in prompts:
                started = time.perf_counter()
                call(prompt)
                times.append(time.perf_counter() - started)
            timings[name] = times
    report = {name: summary_ms(times) for name, times in timings.items()}
    for name in ("gateway", "gateway_stream"):
        report[f"{name}_added"] = {q: round(report[name][q] - report["direct"][q], 3) for q in ("p50_ms", "p99_ms")}
    report["workload"] = {"requests": requests, "input_len": input_len, "max_tokens": max_tokens,
                          "engine": "instant (bench/instant_engine.py)"}
    return report


def through_gateway(engine: Any, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                    stream: bool, processes: int = 1, load_processes: int = 0) -> dict[str, Any]:
    """``prompts`` as OpenAI requests through ``processes`` gateway processes, from
    ``load_processes`` load processes (0: one per 128 connections) released together."""
    from bench.gateway_load import default_processes, run_processes
    from bench.worker import _rates
    from producers.embedded_redis import EmbeddedRedis

    bodies = [{"model": MODEL_NAME, "prompt": p, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
              for p in prompts]
    load_processes = load_processes or default_processes(concurrency)
    cpu: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sluiceway-bench-gw-") as tmp, EmbeddedRedis(appendonly=True) as server, \
            serving(engine, server.url, model, max_connections=2 * concurrency + 64, processes=processes,
                    cpu_seconds=cpu) as url:
        before = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        load = run_processes(url, bodies, concurrency, stream, load_processes, tmp)
        after = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        # NOTE: the only children that end meanwhile are the load processes; this one runs the worker
        for name, i in (("load", 0), ("worker", 1)):
            cpu[name] = round(after[i].ru_utime + after[i].ru_stime - before[i].ru_utime - before[i].ru_stime, 2)
        stats = _command_calls(server.url)
        cpu["redis"] = stats.pop("cpu_seconds")
        arrivals = _arrivals(server.url, load["started_at"])
    if load["errors"]:
        raise RuntimeError(f"{len(load['errors'])} requests failed, e.g. {load['errors'][0]}")
    rates = _rates(len(prompts), load["completion_tokens"], load["seconds"])
    rates["load_processes"] = load["processes"]
    rates["ramp_s"] = load["ramp_s"]  # from the clock's start to the last request sent whole
    rates["sent_p50_s"] = load["sent_p50_s"]
    rates["load_start_spread_s"] = load["start_spread_s"]
    rates["load_cpu_s"] = load["cpu_s"]  # the load processes' CPU from the start on (cpu_seconds: with imports)
    rates["arrivals"] = arrivals
    rates["latency"] = summary_ms(load["latencies"])
    if load["first_chunk"]:
        rates["time_to_first_chunk"] = summary_ms(load["first_chunk"])
    rates["cpu_seconds"] = cpu
    if cpu.get("gateway"):  # NOTE: its start (about 0.75 s on the development machine) included
        rates["gateway_tokens_per_cpu_s"] = round(load["completion_tokens"] / cpu["gateway"], 1)
    rates["redis_calls"] = stats
    rates["xread_per_token"] = round(stats.get("xread", 0) / max(1, load["completion_tokens"]), 4)
    rates["evalsha_per_token"] = round(stats.get("evalsha", 0) / max(1, load["completion_tokens"]), 4)
    return rates


def _arrivals(url: str, started_at: float) -> dict[str, float]:
    """The gateway's and the worker's view of the ramp, from the job hashes: seconds from the
    load's start (wall clock) until the gateway had submitted half / all of the jobs
    (``enqueued_at``), and until the worker had started the last one (``started_at``)."""
    import redis

    from producers.protocol import Keys

    with redis.Redis.from_url(url, decode_responses=True) as client:
        keys = list(client.scan_iter(match=Keys().job("*"), count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "enqueued_at", "started_at")
        rows = pipe.execute()
    enqueued = sorted(float(e) - started_at for e, _ in rows if e)
    started = [float(s) - started_at for _, s in rows if s]
    if not enqueued:
        return {}
    return {"jobs": len(enqueued), "first_enqueued_s": round(enqueued[0], 4),
            "half_enqueued_s": round(enqueued[len(enqueued) // 2], 4), "last_enqueued_s": round(enqueued[-1], 4),
            "last_started_s": round(max(started), 4) if started else None}


def _command_calls(url: str) -> dict[str, int]:
    """Calls of the commands a gateway waits with, as Redis counted them (every client's), and
    the server's CPU seconds (``cpu_seconds``)."""
    import redis

    with redis.Redis.from_url(url) as client:
        stats, cpu = client.info("commandstats"), client.info("cpu")
    calls = {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0)
             for name in ("xread", "blmove", "hgetall", "client|unblock", "evalsha")}
    return {**calls, "cpu_seconds": round(cpu["used_cpu_sys"] + cpu["used_cpu_user"], 2)}


def run_streams(n: int, output_len: int, concurrency: int, max_num_seqs: int, processes: int,
                step_ms: float = 0.0, load_processes: int = 0) -> dict[str, Any]:
    """Streaming capacity on the instant engine at one token a step, a step every ``step_ms``
    (0: as fast as the worker goes; a GPU's cadence otherwise); see the module's docstring."""
    from bench.instant_engine import InstantEngine

    prompts = [[10 + i % 1000, 11, 12, 13] for i in range(n)]
    engine = InstantEngine(max_num_seqs=max_num_seqs, tokens_per_step=1, step_s=step_ms / 1000)
    through = through_gateway(engine, "instant", prompts, output_len, concurrency, stream=True, processes=processes,
                              load_processes=load_processes)
    return {"workload": {"requests": n, "output_len": output_len, "concurrency": concurrency,
                         "max_num_seqs": max_num_seqs, "gateway_processes": processes, "step_ms": step_ms,
                         "load_processes": through["load_processes"],
                         "engine": "instant (bench/instant_engine.py), one token a step"},
            "gateway": through}


def run_throughput(engine: Any, model: str, n: int, input_len: int, output_len: int, concurrency: int,
                   stream: bool, seed: int, processes: int = 1, load_processes: int = 0) -> dict[str, Any]:
    """Offline, through the gateway, offline again (bracketing, as ``bench worker`` does: the
    engine's own speed drifts between back-to-back runs)."""
    from bench.run import make_workload
    from bench.worker import run_offline

    def prompts(offset: int, count: int = n) -> list[list[int]]:
        return make_workload(count, input_len, output_len, engine.vocab_size, 0.0, seed + offset).prompts

    run_offline(engine, prompts(3, min(n, 64)), output_len)  # warm-up
    before = run_offline(engine, prompts(0), output_len)
    through = through_gateway(engine, model, prompts(1), output_len, concurrency, stream, processes, load_processes)
    after = run_offline(engine, prompts(2), output_len)
    offline_mean = (before["output_tok_s"] + after["output_tok_s"]) / 2
    return {"workload": {"requests": n, "input_len": input_len, "output_len": output_len, "concurrency": concurrency,
                         "stream": stream, "gateway_processes": processes,
                         "load_processes": through["load_processes"]},
            "offline": before, "gateway": through, "offline_after": after,
            "gateway_over_offline": round(through["output_tok_s"] / offline_mean, 4)}


@click.command("gateway")
@click.option("--mode", type=click.Choice(["latency", "streams", "throughput"]), default="latency", show_default=True)
@click.option("--requests", type=int, default=300, show_default=True, help="latency: requests, one at a time")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="latency: tokens per request")
@click.option("--model", default="llama3-8b", show_default=True, help="throughput: a model folder or preset")
@click.option("--load-format", default="dummy", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--max-model-len", type=int, default=None)
@click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True)
@click.option("--num-requests", type=int, default=1024, show_default=True)
@click.option("--input-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--concurrency", type=int, default=1024, show_default=True, help="throughput: requests in flight")
@click.option("--stream/--no-stream", default=False, show_default=True, help="throughput: streamed responses")
@click.option("--gateway-workers", type=int, default=1, show_default=True,
              help="throughput: gateway processes (sluiceway serve --workers)")
@click.option("--load-processes", type=int, default=0, show_default=True,
              help="throughput/streams: load processes, each its own client (0: one per 128 connections)")
@click.option("--step-ms", type=float, default=0.0, show_default=True,
              help="streams: the instant engine's step time (0: as fast as it goes)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the results here.")
def gateway_command(mode, requests, max_tokens, model, load_format, device, dtype, max_num_seqs, max_model_len,
                    gpu_memory_utilization, num_requests, input_len, output_len, concurrency, stream, gateway_workers,
                    load_processes, step_ms, seed, json_path) -> None:
    """The gateway's added latency (instant engine), or its throughput against the offline engine."""
    from worker.logs import configure

    configure("WARNING")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if mode == "latency":
        report = {"mode": "latency", **run_latency(requests, min(input_len, 32), max_tokens, seed)}
        click.echo(f"latency: direct p50 {report['direct']['p50_ms']} ms p99 {report['direct']['p99_ms']} ms; "
                   f"gateway adds p50 {report['gateway_added']['p50_ms']} ms p99 {report['gateway_added']['p99_ms']}"
                   f" ms (streamed: {report['gateway_stream_added']['p50_ms']} / "
                   f"{report['gateway_stream_added']['p99_ms']} ms)")
    elif mode == "streams":
        report = {"mode": "streams", **run_streams(num_requests, output_len, concurrency, max_num_seqs,
                                                   gateway_workers, step_ms, load_processes)}
        click.echo(f"streams: {report['gateway']['output_tok_s']:.1f} streamed tok/s through {gateway_workers} "
                   f"gateway process(es), {report['gateway']['xread_per_token']} XREAD and "
                   f"{report['gateway']['evalsha_per_token']} EVALSHA per token, "
                   f"{report['gateway'].get('gateway_tokens_per_cpu_s')} tokens per gateway CPU second "
                   f"({report['workload']})")
    else:
        from bench.worker import _environment
        from engine import EngineArgs, LLMEngine

        kwargs = dict(model=model, load_format=load_format, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, seed=seed)
        engine = LLMEngine(EngineArgs(**kwargs))
        try:
            report = {"mode": "throughput", "engine_args": {k: v for k, v in kwargs.items() if v is not None},
                      "environment": _environment(engine),
                      **run_throughput(engine, model, num_requests, input_len, output_len, concurrency, stream, seed,
                                        gateway_workers, load_processes)}
        finally:
            engine.shutdown()
        click.echo(f"throughput: offline {report['offline']['output_tok_s']:.1f} / "
                   f"{report['offline_after']['output_tok_s']:.1f} tok/s (before / after), through the gateway "
                   f"{report['gateway']['output_tok_s']:.1f} tok/s, "
                   f"gateway/offline {report['gateway_over_offline']:.3f}, "
                   f"ramp {report['gateway']['ramp_s']} s (last sent; gateway's last arrival "
                   f"{report['gateway']['arrivals'].get('last_enqueued_s')} s) from "
                   f"{report['gateway']['load_processes']} load processes ({report['workload']})")
    print_report(report, json_path)


if __name__ == "__main__":
    gateway_command()
