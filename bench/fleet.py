"""``sluiceway bench fleet``: what one Redis costs per job, with K real worker processes whose
engine is free (``bench/instant_engine.py``), so that Redis and the protocol are all there is.

Phases, on one Redis (a private ``redis-server``, or ``--redis URL``), or on a Redis Cluster
(``--cluster-masters M``: a private cluster of M masters; or a ``redis+cluster://`` ``--redis``)
in the cluster layout (``--queue-shards N``; workers and producers alike):

1. idle: K workers up, no jobs, ``--idle-seconds`` long: commands per second an idle worker costs;
2. load: P producer processes, each keeping ``--window`` jobs in flight (submit them in one
   pipelined call, wait on each result, repeat) until ``--jobs`` have ended.

Reported: jobs/s end to end (first enqueue to last end, the server's clocks), Redis commands
and bytes per job (``INFO commandstats``, ``INFO stats``), p50/p99 queue-to-result latency
(``finished_at - enqueued_at`` of each job hash), Redis CPU seconds per 1,000 jobs
(``INFO cpu``, user + system of the server). On a cluster every counter is the sum over its
masters, and ``by_master`` gives each master's share (the slots of N shards spread unevenly).
docs/SCALING.md turns them into fleet sizes.

    sluiceway bench fleet --workers 4 --producers 2 --jobs 20000 --output-len 8 --json fleet.json
    sluiceway bench fleet --cluster-masters 3 --queue-shards 6 --jobs 20000 --output-len 8
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from typing import Any

import click
import redis

from producers.connection import connect, connection_kwargs_of, is_cluster_client
from producers.protocol import Keys


def master_clients(url: str) -> list[redis.Redis]:
    """A plain client of each server whose counters a run sums: the server of ``url``, or every
    primary of the cluster it names."""
    r = connect(url, decode_responses=True)
    if not is_cluster_client(r):
        return [r]
    nodes = sorted(r.get_primaries(), key=lambda n: (n.host, n.port))
    kwargs = {k: v for k, v in connection_kwargs_of(r).items() if k in ("username", "password", "ssl")}
    r.close()
    return [redis.Redis(host=n.host, port=n.port, decode_responses=True, **kwargs) for n in nodes]


def cluster_counters(masters: list[redis.Redis]) -> list[dict[str, Any]]:
    return [redis_counters(m) for m in masters]


def summed(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's differences over every master, added up (``seconds``: the longest)."""
    commands: dict[str, int] = {}
    for part in parts:
        for k, n in part["commands"].items():
            commands[k] = commands.get(k, 0) + n
    return {"commands": dict(sorted(commands.items(), key=lambda kv: -kv[1])),
            "net_in": sum(p["net_in"] for p in parts), "net_out": sum(p["net_out"] for p in parts),
            "cpu_s": sum(p["cpu_s"] for p in parts), "seconds": max(p["seconds"] for p in parts)}


def redis_counters(r: redis.Redis) -> dict[str, Any]:
    """The server's cumulative counters a phase is the difference of."""
    stats, cpu = r.info("stats"), r.info("cpu")
    commands = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in r.info("commandstats").items()}
    return {"commands": commands, "net_in": int(stats["total_net_input_bytes"]),
            "net_out": int(stats["total_net_output_bytes"]),
            "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), "at": time.monotonic()}


def difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    # NOTE: INFO is the bench's own reading of the counters, not the fleet's
    commands = {k: n - before["commands"].get(k, 0) for k, n in after["commands"].items() if k != "info"}
    return {"commands": {k: n for k, n in sorted(commands.items(), key=lambda kv: -kv[1]) if n},
            "net_in": after["net_in"] - before["net_in"], "net_out": after["net_out"] - before["net_out"],
            "cpu_s": after["cpu_s"] - before["cpu_s"], "seconds": after["at"] - before["at"]}


def produce(url: str, jobs: int, window: int, prompt_len: int, output_len: int, stream: bool, seed: int,
            queue_shards: int = 0) -> list[str]:
    """One producer process: ``jobs`` jobs, ``window`` in flight at a time; returns their ids."""
    from producers.client import Client

    job = {"prompt_token_ids": [10 + (seed + i) % 1000 for i in range(prompt_len)],
           "sampling": {"max_tokens": output_len, "temperature": 0}, "stream": stream}
    ids: list[str] = []
    with Client(url, queue="bulk", socket_timeout=120, queue_shards=queue_shards) as client:
        while len(ids) < jobs:
            batch = client.submit_many([job] * min(window, jobs - len(ids)))
            for job_id in batch:
                if stream:
                    for _ in client.stream_deltas(job_id, timeout=120):
                        pass
                else:
                    client.result(job_id, timeout=120)
            ids += batch
    return ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Fleet:
    """K ``bench.fleet_worker`` processes on one Redis URL."""

    def __init__(self, url: str, workers: int, max_num_seqs: int, tokens_per_step: int = 0,
                 step_ms: float = 0.0, stream_interval_ms: float = 0.0, queue_shards: int = 0) -> None:
        self.url = url
        # NOTE: the workers read every other setting from the environment, as `sluiceway worker` does
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLUICEWAY_STREAM_INTERVAL_MS": str(stream_interval_ms)}
        self.procs = [subprocess.Popen([sys.executable, "-m", "bench.fleet_worker", url, f"fleet-{i}",
                                        str(max_num_seqs), str(tokens_per_step), str(step_ms), str(queue_shards)],
                                       env=env, stdin=subprocess.DEVNULL)
                      for i in range(workers)]

    def wait_up(self, r: redis.Redis, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while r.hlen(Keys().workers) < len(self.procs):
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a fleet worker exited before its first heartbeat")
            if time.monotonic() > deadline:
                raise TimeoutError(f"fleet workers did not heartbeat within {timeout}s")
            time.sleep(0.05)  # NOTE: a heartbeat is a hash write; nothing to block on

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_fleet(url: str, *, workers: int, producers: int, jobs: int, window: int, prompt_len: int,
              output_len: int, stream: bool, max_num_seqs: int, idle_seconds: float, tokens_per_step: int = 0,
              step_ms: float = 0.0, stream_interval_ms: float = 0.0, queue_shards: int = 0) -> dict[str, Any]:
    """One measured run on ``url`` (an empty Redis or Redis Cluster): the idle phase, then the load phase."""
    r = connect(url, decode_responses=True)
    masters = master_clients(url)
    fleet = Fleet(url, workers, max_num_seqs, tokens_per_step, step_ms, stream_interval_ms, queue_shards)
    try:
        fleet.wait_up(r)
        idle_before = cluster_counters(masters)
        time.sleep(idle_seconds)  # NOTE: the idle phase is a length of time, by definition
        idle = summed([difference(b, a) for b, a in zip(idle_before, cluster_counters(masters))])
        before = cluster_counters(masters)
        share = [jobs // producers + (1 if i < jobs % producers else 0) for i in range(producers)]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(producers) as pool:
            batches = pool.starmap(produce, [(url, n, window, prompt_len, output_len, stream, i * 7919, queue_shards)
                                             for i, n in enumerate(share)])
        per_master = [difference(b, a) for b, a in zip(before, cluster_counters(masters))]
        load = summed(per_master)
    finally:
        fleet.stop()
        for m in masters:
            m.close()
    ids = [j for batch in batches for j in batch]
    keys = Keys(shards=queue_shards)
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(keys.job(job_id), ["status", "enqueued_at", "finished_at"])
        rows = pipe.execute()
    r.close()
    bad = [s for s, _, _ in rows if s != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(ids)} jobs did not end done: {sorted(set(bad))}")
    latencies = [float(f) - float(e) for _, e, f in rows]
    span = max(float(f) for _, _, f in rows) - min(float(e) for _, e, _ in rows)
    n = len(ids)
    idle_per_worker_s = {k: round(v / idle["seconds"] / workers, 2) for k, v in idle["commands"].items()}
    return {
        "workload": {"workers": workers, "producers": producers, "jobs": n, "window": window,
                     "masters": len(per_master), "queue_shards": queue_shards,
                     "prompt_len": prompt_len, "output_len": output_len, "stream": stream,
                     "max_num_seqs": max_num_seqs, "tokens_per_step": tokens_per_step, "step_ms": step_ms,
                     "stream_interval_ms": stream_interval_ms},
        "jobs_per_s": round(n / span, 1),
        "latency_s": {"p50": round(percentile(latencies, 0.5), 5), "p99": round(percentile(latencies, 0.99), 5)},
        "commands_per_job": round(sum(load["commands"].values()) / n, 2),
        "commands_per_job_by_name": {k: round(v / n, 3) for k, v in load["commands"].items()},
        "bytes_in_per_job": round(load["net_in"] / n), "bytes_out_per_job": round(load["net_out"] / n),
        "redis_cpu_s_per_1000_jobs": round(1000 * load["cpu_s"] / n, 4),
        "redis_cpu_share_during_load": round(load["cpu_s"] / load["seconds"], 3),
        "idle_commands_per_s_per_worker": round(sum(idle_per_worker_s.values()), 2),
        "idle_commands_per_s_per_worker_by_name": idle_per_worker_s,
        "idle_redis_cpu_share": round(idle["cpu_s"] / idle["seconds"], 4),
        # NOTE: each master's part of the load phase: a cluster is as full as its busiest master
        "by_master": [{"commands_per_job": round(sum(p["commands"].values()) / n, 2),
                       "redis_cpu_s_per_1000_jobs": round(1000 * p["cpu_s"] / n, 4),
                       "redis_cpu_share_during_load": round(p["cpu_s"] / p["seconds"], 3)} for p in per_master],
        "busiest_master_cpu_over_mean": round(max(p["cpu_s"] for p in per_master) * len(per_master)
                                              / max(1e-9, load["cpu_s"]), 2),
    }


@click.command("bench-fleet")
@click.option("--workers", type=int, default=4, show_default=True, help="Worker processes (K).")
@click.option("--producers", type=int, default=2, show_default=True, help="Producer processes.")
@click.option("--jobs", type=int, default=20000, show_default=True)
@click.option("--window", type=int, default=256, show_default=True, help="Jobs each producer keeps in flight.")
@click.option("--prompt-len", type=int, default=128, show_default=True, help="Prompt token ids per job.")
@click.option("--output-len", type=int, default=8, show_default=True, help="Tokens per result (8: a grading verdict).")
@click.option("--stream/--no-stream", default=False, show_default=True, help="Jobs stream their tokens.")
@click.option("--max-num-seqs", type=int, default=256, show_default=True, help="Each worker's engine capacity.")
@click.option("--tokens-per-step", type=int, default=0, show_default=True,
              help="Tokens each job gets per engine step (0: all at the first step).")
@click.option("--step-ms", type=float, default=0.0, show_default=True, help="How long each engine step lasts.")
@click.option("--stream-interval-ms", type=float, default=0.0, show_default=True,
              help="The workers' --stream-interval-ms.")
@click.option("--idle-seconds", type=float, default=3.0, show_default=True)
@click.option("--redis", "redis_url", default=None,
              help="An empty Redis (or redis+cluster:// Redis Cluster) to measure (default: a private redis-server).")
@click.option("--redis-server", default=None, help="The redis-server binary of the private server or cluster.")
@click.option("--cluster-masters", type=int, default=0, show_default=True,
              help="Measure a private Redis Cluster of this many masters (0: one redis-server); needs --queue-shards.")
@click.option("--queue-shards", type=int, default=0, show_default=True,
              help="The cluster layout's shards per queue, for workers and producers (0: the single-node layout).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the results here.")
def fleet_command(workers, producers, jobs, window, prompt_len, output_len, stream, max_num_seqs, tokens_per_step,
                  step_ms, stream_interval_ms, idle_seconds, redis_url, redis_server, cluster_masters, queue_shards,
                  json_path) -> None:
    """K workers with an instant engine against one Redis or a Redis Cluster: jobs/s, commands, bytes, CPU per job."""
    from producers.embedded_cluster import EmbeddedCluster
    from producers.protocol.keys import MAX_QUEUE_SHARDS
    from worker.embedded_redis import EmbeddedRedis

    for name, value in (("workers", workers), ("producers", producers), ("jobs", jobs), ("window", window)):
        if value < 1:
            raise click.BadParameter(f"must be >= 1, got {value}", param_hint=f"--{name}")
    if not 0 <= cluster_masters <= 64:
        raise click.BadParameter(f"must be from 0 to 64, got {cluster_masters}", param_hint="--cluster-masters")
    if not 0 <= queue_shards <= MAX_QUEUE_SHARDS:
        raise click.BadParameter(f"must be from 0 to {MAX_QUEUE_SHARDS}, got {queue_shards}",
                                 param_hint="--queue-shards")
    if cluster_masters and not queue_shards:
        raise click.BadParameter(f"a cluster ({cluster_masters} masters) runs the cluster layout alone: "
                                 "give --queue-shards N >= 1", param_hint="--queue-shards")
    if cluster_masters and redis_url:
        raise click.BadParameter("--redis names a server to measure; --cluster-masters builds one: give one of them",
                                 param_hint="--cluster-masters")
    options = dict(workers=workers, producers=producers, jobs=jobs, window=window, prompt_len=prompt_len,
                   output_len=output_len, stream=stream, max_num_seqs=max_num_seqs, idle_seconds=idle_seconds,
                   tokens_per_step=tokens_per_step, step_ms=step_ms, stream_interval_ms=stream_interval_ms,
                   queue_shards=queue_shards)
    if redis_url:
        report = run_fleet(redis_url, **options)
        first, *others = master_clients(redis_url)
        server_version = first.info("server")["redis_version"]
        for client in (first, *others):
            client.close()
    elif cluster_masters:
        with EmbeddedCluster(cluster_masters, executable=redis_server) as cluster:
            report = run_fleet(cluster.url, **options)
            server_version = cluster.nodes[0].client().info("server")["redis_version"]
    else:
        with EmbeddedRedis(executable=redis_server) as server:
            report = run_fleet(server.url, **options)
            server_version = server.client().info("server")["redis_version"]
    report["environment"] = {"python": platform.python_version(), "host": platform.node(),
                             "cpus": os.cpu_count(), "redis": server_version}
    text = json.dumps(report, indent=2)
    if json_path:  # NOTE: before the output, which a closed pipe may cut short
        with open(json_path, "w") as f:
            f.write(text + "\n")
    click.echo(f"fleet: {report['jobs_per_s']} jobs/s, {report['commands_per_job']} commands/job, "
               f"{report['bytes_in_per_job']}+{report['bytes_out_per_job']} bytes/job in+out, "
               f"Redis CPU {report['redis_cpu_s_per_1000_jobs']} s per 1,000 jobs, latency p50 "
               f"{report['latency_s']['p50'] * 1000:.1f} ms p99 {report['latency_s']['p99'] * 1000:.1f} ms, "
               f"idle worker {report['idle_commands_per_s_per_worker']} commands/s"
               + (f", busiest of {len(report['by_master'])} masters at {report['busiest_master_cpu_over_mean']}x "
                  "the mean CPU" if len(report["by_master"]) > 1 else ""))
    click.echo(text)


if __name__ == "__main__":
    fleet_command()
