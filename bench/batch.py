"""``sluiceway bench batch``: the OpenAI Batch API end to end, a gateway process and a worker.

Two modes, each with a private redis-server, a gateway process (``create_app``, uvicorn) and a
worker in this process:

- ``--engine instant`` (CPU; the default): a bench-only engine that answers at once
  (``bench/instant_engine.py``), so what is measured is the gateway, its feeder and Redis. A
  batch of ``--rows`` completion lines (100,000 by default, 32 prompt token ids, one token
  out) runs while the gateway's RSS and Redis's ``used_memory`` are sampled. With
  ``--files-dir`` the answers go to their files as rows end and both should stay flat; without
  it Redis grows by the output lines it keeps (reported beside it).
- ``--engine real``: the throughput workload (1,024 requests, 512 prompt tokens, 256 output,
  ignore_eos) on a real engine (dummy weights), offline before and after, and between them as
  a batch file through ``/v1/files`` and ``/v1/batches``. The target is ``batch_over_offline``
  >= 0.95. ``scripts/gpu_batch.sh`` runs it on the H200.

    python -m bench batch --rows 100000 --json bench-batch.json
    python -m bench batch --engine real --model llama3-8b --load-format dummy --json out.json
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from bench.common import print_report
from producers.protocol.batch_keys import BatchKeys
from producers.protocol.batch_statuses import BATCH_ENDED

SERVE = ("import sys, uvicorn; from gateway.app import create_app; from gateway.settings import GatewaySettings;"
         " uvicorn.run(create_app(GatewaySettings(redis=sys.argv[1])), host='127.0.0.1', port=int(sys.argv[2]),"
         " log_level='warning')")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Stack:
    """A private Redis, a gateway process on it and a worker thread on ``engine``."""

    def __init__(self, engine: Any, model: str, env: dict[str, str], appendonly: bool) -> None:
        import httpx

        from worker.embedded_redis import EmbeddedRedis, free_port
        from worker.loop import Worker
        from worker.settings import WorkerSettings

        self.redis_server = EmbeddedRedis(appendonly=appendonly).start()
        self.r = self.redis_server.client(decode_responses=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")} | env
        self.gateway = subprocess.Popen([sys.executable, "-c", SERVE, self.redis_server.url, str(port)], env=environ)
        settings = WorkerSettings(model=model, redis=self.redis_server.url, name="bench", swap_space="0",
                                  log_level="WARNING", served_model_name=model)
        self.worker = Worker(settings, engine=engine)
        self.thread = threading.Thread(target=self.worker.work, name="sluiceway-bench-worker", daemon=True)
        self.thread.start()
        self.http = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.gateway.poll() is not None:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.2)

    def run_batch(self, lines: bytes, endpoint: str, sample_s: float) -> dict[str, Any]:
        """Upload, create, sample until it ends; the batch hash's times and the samples."""
        started = time.time()
        file_id = self.http.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(lines))},
                                 data={"purpose": "batch"}).raise_for_status().json()["id"]
        uploaded = time.time()
        batch = self.http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                    "completion_window": "24h"}).raise_for_status().json()
        keys = BatchKeys()
        key = keys.batch(batch["id"])
        samples: list[dict[str, Any]] = []
        ended = None
        while True:
            meta = self.r.hgetall(key)
            memory = self.r.info("memory")
            samples.append({"t": round(time.time() - started, 2), "completed": int(meta.get("completed") or 0),
                            "gateway_rss_mib": round(rss_bytes(self.gateway.pid) / 2**20, 1),
                            "redis_used_mib": round(memory["used_memory"] / 2**20, 1),
                            "output_mib": round(int(meta.get("output_bytes") or 0) / 2**20, 1),
                            "gateway_cpu_s": round(cpu_seconds(self.gateway.pid), 2),
                            "redis_cpu_s": round(float(self.r.info("cpu")["used_cpu_user"])
                                                 + float(self.r.info("cpu")["used_cpu_sys"]), 2)})
            # NOTE: one sample more once the feeder has cleaned up after the end (the active set)
            if ended is not None and not self.r.sismember(keys.active, batch["id"]):
                break
            if ended is None and meta.get("status") in BATCH_ENDED:
                ended = meta
                continue
            time.sleep(sample_s)
        meta = ended
        if meta["status"] != "completed" or int(meta["failed"]):
            raise RuntimeError(f"the batch ended {meta['status']} with {meta['failed']} failed rows:"
                               f" {meta.get('errors')}")
        return {"upload_s": round(uploaded - started, 3),
                "batch_s": round(float(meta["finalizing_at"]) - float(meta["created_at"]), 3),
                "completed": int(meta["completed"]), "gateway_cpu_s": samples[-1]["gateway_cpu_s"],
                "redis_cpu_s": samples[-1]["redis_cpu_s"], "samples": samples}

    def close(self) -> None:
        self.gateway.send_signal(signal.SIGTERM)
        self.gateway.wait(30)
        self.worker.request_stop()
        self.thread.join(60)
        self.http.close()
        self.r.close()
        self.redis_server.stop()
        self.redis_server.cleanup()


def token_lines(prompts: list[list[int]], model: str, output_len: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                                         "ignore_eos": True}}).encode() + b"\n" for i, p in enumerate(prompts))


def flatness(samples: list[dict[str, Any]], answers_in_redis: bool = True) -> dict[str, Any]:
    """First, peak and last of each sampled series (Redis also less the output lines it keeps:
    none with a files directory)."""
    def series(name: str) -> dict[str, float]:
        values = [s[name] for s in samples]
        return {"first": values[0], "peak": max(values), "last": values[-1]}

    state = [round(s["redis_used_mib"] - (s["output_mib"] if answers_in_redis else 0), 1) for s in samples]
    return {"gateway_rss_mib": series("gateway_rss_mib"), "redis_used_mib": series("redis_used_mib"),
            "redis_less_output_mib": {"first": state[0], "peak": max(state), "last": state[-1]}}


def instant(rows: int, max_outstanding: int, sample_s: float, appendonly: bool,
            files_dir: str | None = None) -> dict[str, Any]:
    from bench.instant_engine import InstantEngine

    model = "instant"
    env = {"SLUICEWAY_BATCH_MAX_OUTSTANDING": str(max_outstanding), "SLUICEWAY_BATCH_MAX_FILE_BYTES": str(2**30)}
    if files_dir:
        env["SLUICEWAY_BATCH_FILES_DIR"] = files_dir
    else:  # NOTE: the bench measures what a batch in Redis costs: past the row limit too
        env["SLUICEWAY_BATCH_MAX_ROWS_IN_REDIS"] = str(max(rows, 1))
    stack = Stack(InstantEngine(), model, env, appendonly)
    try:
        # NOTE: prompts as token ids: the instant engine has no tokenizer (a grading row's size)
        prompts = [[10 + (i + j) % 30_000 for j in range(32)] for i in range(rows)]
        lines = token_lines(prompts, model, 1)
        result = stack.run_batch(lines, "/v1/completions", sample_s)
    finally:
        stack.close()
    result["rows"], result["input_mib"] = rows, round(len(lines) / 2**20, 1)
    result["rows_per_s"] = round(rows / result["batch_s"], 1)
    result["answers_in"] = "files_dir" if files_dir else "redis"
    result["memory"] = flatness(result["samples"], answers_in_redis=not files_dir)
    return result


def real(engine: Any, model: str, n: int, input_len: int, output_len: int, seed: int, sample_s: float,
         appendonly: bool) -> dict[str, Any]:
    from bench.worker import make_prompts, run_offline

    run_offline(engine, make_prompts(min(n, 64), input_len, engine.vocab_size, seed + 3), output_len)  # warm-up
    before = run_offline(engine, make_prompts(n, input_len, engine.vocab_size, seed), output_len)
    env = {"SLUICEWAY_BATCH_MAX_OUTSTANDING": str(max(1000, 2 * n)), "SLUICEWAY_BATCH_MAX_FILE_BYTES": str(2**30)}
    stack = Stack(engine, model, env, appendonly)
    try:
        lines = token_lines(make_prompts(n, input_len, engine.vocab_size, seed + 1), model, output_len)
        through = stack.run_batch(lines, "/v1/completions", sample_s)
    finally:
        stack.close()
    after = run_offline(engine, make_prompts(n, input_len, engine.vocab_size, seed + 2), output_len)
    tokens = n * output_len
    through["output_tok_s"] = round(tokens / through["batch_s"], 2)
    offline_mean = (before["output_tok_s"] + after["output_tok_s"]) / 2
    return {"workload": {"requests": n, "input_len": input_len, "output_len": output_len},
            "offline": before, "batch": {k: v for k, v in through.items() if k != "samples"},
            "offline_after": after, "batch_over_offline": round(through["output_tok_s"] / offline_mean, 4),
            "memory": flatness(through["samples"])}


@click.command("bench-batch")
@click.option("--engine", "engine_kind", type=click.Choice(["instant", "real"]), default="instant", show_default=True)
@click.option("--rows", type=int, default=100_000, show_default=True, help="instant: rows of the batch.")
@click.option("--max-outstanding", type=int, default=1000, show_default=True, help="instant: jobs in flight.")
@click.option("--model", default="llama3-8b", show_default=True, help="real: a model folder or preset name.")
@click.option("--load-format", default="dummy", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--num-requests", type=int, default=1024, show_default=True)
@click.option("--input-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--sample-seconds", type=float, default=1.0, show_default=True)
@click.option("--files-dir", type=click.Path(file_okay=False), default=None,
              help="instant: the gateway's SLUICEWAY_BATCH_FILES_DIR (answers go to files as rows end, not to Redis).")
@click.option("--appendonly/--no-appendonly", default=True, show_default=True, help="AOF on the private Redis.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def batch_command(engine_kind, rows, max_outstanding, model, load_format, device, max_num_seqs, num_requests,
                  input_len, output_len, sample_seconds, files_dir, appendonly, seed, json_path) -> None:
    """A batch through /v1/files and /v1/batches: memory over time (instant) or vs offline (real)."""
    from worker.logs import configure

    configure("WARNING")
    if engine_kind == "instant":
        report = {"mode": "instant", **instant(rows, max_outstanding, sample_seconds, appendonly, files_dir)}
        m = report["memory"]
        click.echo(f"{rows:,} rows in {report['batch_s']:.1f}s ({report['rows_per_s']:.0f} rows/s); gateway RSS"
                   f" {m['gateway_rss_mib']['first']} -> peak {m['gateway_rss_mib']['peak']} MiB; Redis used"
                   f" {m['redis_used_mib']['first']} -> {m['redis_used_mib']['last']} MiB, less output"
                   f" {m['redis_less_output_mib']['first']} -> peak {m['redis_less_output_mib']['peak']} MiB")
    else:
        from engine import EngineArgs, LLMEngine

        engine = LLMEngine(EngineArgs(model=model, load_format=load_format, device=device, max_num_seqs=max_num_seqs,
                                      seed=seed))
        try:
            report = {"mode": "real", "model": model,
                      **real(engine, model, num_requests, input_len, output_len, seed, sample_seconds, appendonly)}
        finally:
            engine.shutdown()
        click.echo(f"offline {report['offline']['output_tok_s']:.1f} / {report['offline_after']['output_tok_s']:.1f}"
                   f" tok/s, batch {report['batch']['output_tok_s']:.1f} tok/s, batch/offline"
                   f" {report['batch_over_offline']:.3f}")
    print_report(report, json_path)


if __name__ == "__main__":
    batch_command()
