"""``sluiceway demo``: the whole path on one machine, in a few seconds.

A private redis-server, a tiny local model (random weights, a real tokenizer; built once
into a cache folder), a worker in this process, a few jobs through the producer client --
one of them streamed -- and, when celery is installed, one Celery task on the same Redis;
their results printed, then a clean shutdown.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import click

DEMO_JOBS = [
    dict(prompt="What is the capital of France?", sampling={"temperature": 0, "max_tokens": 16}),
    dict(messages=[{"role": "user", "content": "Hello, world!"}], sampling={"temperature": 0, "max_tokens": 16},
         queue="interactive"),
    dict(prompt="Grade the following answer", sampling={"temperature": 0.8, "seed": 1, "max_tokens": 12, "n": 2},
         queue="bulk", metadata={"row": 17}),
]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sluiceway" / "demo-tiny-llama"


def celery_task(url: str) -> bool:
    """Send one ``sluiceway.generate`` task as a Celery app would, wait for it, print it; False without celery."""
    try:
        from celery import Celery
    except ImportError:
        return False
    from producers.celery_app import CELERY_QUEUE, generate_signature

    prompt = "What is 2 + 2?"
    app = Celery("demo-app", broker=url, backend=url)
    try:
        res = generate_signature(prompt=prompt, sampling={"temperature": 0, "max_tokens": 8}, app=app).apply_async()
        result = res.get(timeout=60)
    finally:
        app.close()
    click.echo(f"celery task {res.id[:8]} [{CELERY_QUEUE}] {prompt!r} -> {res.state}")
    for i, out in enumerate(result["outputs"]):
        click.echo(f"  output {i}: {out['text']!r} ({len(out['token_ids'])} tokens, {out['finish_reason']})")
    return True


def tiny_model(cache_dir: Path) -> Path:
    """The demo's model, built on first use."""
    if not (cache_dir / "config.json").is_file():
        from engine.models.tiny import build_tiny_model

        click.echo(f"building a tiny llama (random weights) in {cache_dir} ...")
        build_tiny_model(cache_dir, arch="llama")
    return cache_dir


@click.command("demo")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the tiny model is built and kept (default: ~/.cache/sluiceway/demo-tiny-llama).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="cpu", show_default=True)
@click.option("--verbose", is_flag=True, help="Show the worker's log lines.")
def demo_command(cache_dir: Path | None, device: str, verbose: bool) -> None:
    """Run a worker on a tiny local model against a private Redis and push a few jobs through it."""
    from producers.client import Client
    from worker.embedded_redis import EmbeddedRedis
    from worker.logs import configure
    from worker.loop import Worker
    from worker.settings import WorkerSettings

    configure("INFO" if verbose else "WARNING")
    model = tiny_model(cache_dir or default_cache_dir())
    with EmbeddedRedis(die_with_parent=True) as server:
        click.echo(f"redis:  {server.url} (a private redis-server, gone when the demo ends)")
        settings = WorkerSettings(model=str(model), redis=server.url, name="demo", device=device, max_num_seqs=8,
                                  swap_space="0.05", cancel_poll_seconds=0.05, grace_period=10)
        worker = Worker(settings)
        thread = threading.Thread(target=worker.work, name="sluiceway-demo-worker", daemon=True)
        thread.start()
        click.echo(f"worker: {settings.name} on {device}, model {model} (random weights: the text is noise)\n")
        started = time.monotonic()
        try:
            with Client(server.url, socket_timeout=60) as client:
                streamed = client.submit("Once upon a time", sampling={"temperature": 0, "max_tokens": 24}, stream=True)
                ids = [client.submit(**job) for job in DEMO_JOBS]
                click.echo(f"streamed job {streamed[:8]}: ", nl=False)
                for text in client.stream(streamed, timeout=60):
                    click.echo(repr(text)[1:-1], nl=False)
                click.echo("\n")
                for job_id, job in zip(ids, DEMO_JOBS):
                    result = client.result(job_id, timeout=60)
                    status = client.status(job_id)
                    asked = job.get("prompt") or job["messages"][-1]["content"]
                    click.echo(f"job {job_id[:8]} [{status.queue}] {asked!r}")
                    for i, out in enumerate(result.outputs):
                        click.echo(f"  output {i}: {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
                    click.echo(f"  usage {result.usage.prompt_tokens}+{result.usage.completion_tokens} tokens,"
                               f" total {result.timings.total_s:.3f}s, metadata {result.metadata}")
            through_celery = celery_task(server.url)
        finally:
            worker.request_stop()
            thread.join(30)
        jobs = len(ids) + 1 + through_celery
        click.echo(f"\n{jobs} jobs in {time.monotonic() - started:.2f}s; worker stopped cleanly.")
