"""Soak the bulk path: N rows through ``sluiceway bulk`` and a worker, while both are cut down.

    python scripts/bulk_soak.py --rows 100000 [--model PATH|NAME] [--device cpu|cuda] [--json F]

A private redis-server; a worker (``sluiceway worker``) and the bulk CLI as child processes.
When OUT holds ``--interrupt-at`` of the rows the CLI gets SIGINT (Ctrl-C) and is started
again with the same command; when it holds ``--kill-at`` the worker is SIGKILLed and a new
one of the same name takes over its unacknowledged jobs. At the end it checks, from OUT and
from Redis, what the pipeline promises:

- OUT has one line per input row, in input order, each ``done`` with its row's metadata;
- the queue was given each row once (one job hash per row; no row on a retry attempt);
- each job ended exactly once (its done list holds one element);
- only jobs in flight when the worker died ran twice (``attempts`` 2, at most what it held).

Prints one JSON object (also written to ``--json``); exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producers.protocol import CONSUMER_GROUP, DEFAULT_PREFIX  # noqa: E402
from worker.embedded_redis import EmbeddedRedis  # noqa: E402

CLI = [sys.executable, "-m", "sluiceway"]  # run from ROOT (cwd)


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


def start_worker(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(CLI + ["worker", *args], stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)


def start_bulk(args: list[str], log: Path) -> subprocess.Popen:
    # NOTE: a shell's background job ignores SIGINT, and children inherit that; the CLI here
    # must take Ctrl-C as it would in a terminal.
    return subprocess.Popen(CLI + ["bulk", *args], stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_rows(out: Path, target: int, procs: list[subprocess.Popen], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = count_lines(out)
        if n >= target:
            return n
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[3]} exited with {p.returncode} at {n} rows")
        time.sleep(0.2)
    raise TimeoutError(f"OUT held {count_lines(out)} rows, not {target}, after {timeout_s:.0f} s")


@click.command()
@click.option("--rows", type=click.IntRange(min=10), default=100_000, show_default=True)
@click.option("--model", default=None, help="model folder or built-in name (default: the demo's tiny llama)")
@click.option("--device", default="auto", show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--interrupt-at", type=click.FloatRange(0, 1), default=0.3, show_default=True)
@click.option("--kill-at", type=click.FloatRange(0, 1), default=0.6, show_default=True)
@click.option("--max-outstanding", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--worker-arg", multiple=True, help="extra `sluiceway worker` flag (repeatable)")
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="seconds for the whole run")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(rows, model, device, max_tokens, interrupt_at, kill_at, max_outstanding, worker_arg, timeout, workdir,
         json_path):
    work = workdir or Path(tempfile.mkdtemp(prefix="bulk-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    if model is None:
        from worker.demo import default_cache_dir, tiny_model

        model = str(tiny_model(default_cache_dir()))
    src, out, log = work / "in.jsonl", work / "out.jsonl", work / "soak.log"
    out.unlink(missing_ok=True)
    out.with_name(out.name + ".key").unlink(missing_ok=True)  # a fresh run: fresh row ids
    with src.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": f"Grade answer {i}: the capital of France is Paris.",
                                "sampling": {"temperature": 0.8, "seed": i, "max_tokens": max_tokens,
                                             "ignore_eos": True},
                                "metadata": {"row": i}}) + "\n")
    server = EmbeddedRedis(work / "redis")
    server.start()
    url = server.url
    worker_args = ["--model", model, "--redis", url, "--device", device, "--name", "soak",
                   "--claim-idle-seconds", "10", "--log-level", "WARNING", *worker_arg]
    bulk_args = [str(src), str(out), "--redis", url, "--max-outstanding", str(max_outstanding), "--no-progress"]
    report: dict = {"rows": rows, "model": model, "device": device, "max_tokens": max_tokens, "workdir": str(work),
                    "events": []}
    t0 = time.monotonic()

    def event(what: str, **kw) -> None:
        report["events"].append(dict(t_s=round(time.monotonic() - t0, 2), what=what, out_rows=count_lines(out), **kw))
        click.echo(json.dumps(report["events"][-1]), err=True)

    worker = start_worker(worker_args, log)
    bulk = start_bulk(bulk_args, log)
    try:
        wait_for_rows(out, int(rows * interrupt_at), [worker, bulk], timeout)
        bulk.send_signal(signal.SIGINT)
        rc = bulk.wait(60)
        event("bulk CLI interrupted (SIGINT)", returncode=rc)
        bulk = start_bulk(bulk_args, log)
        event("bulk CLI restarted")
        wait_for_rows(out, int(rows * kill_at), [worker, bulk], timeout)
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        # what it held: its pending entries, frozen once it is dead
        held = len(redis.Redis.from_url(url).xpending_range(f"{DEFAULT_PREFIX}:queue:bulk", CONSUMER_GROUP, "-",
                                                            "+", count=100_000, consumername="soak"))
        event("worker killed (SIGKILL)", jobs_it_held=held)
        report["held_at_kill"] = held
        worker = start_worker(worker_args, log)
        event("worker restarted")
        rc = bulk.wait(max(1.0, timeout - (time.monotonic() - t0)))
        event("bulk CLI finished", returncode=rc)
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        worker.send_signal(signal.SIGTERM)
        event("worker stopped (SIGTERM)", returncode=worker.wait(120))
        report["checks"] = check(url, out, rows, report["held_at_kill"])
    finally:
        for p in (bulk, worker):
            if p.poll() is None:
                p.kill()
        report["redis_used_memory_mb"] = round(redis.Redis.from_url(url).info("memory")["used_memory"] / 2**20, 1)
        server.stop()
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    text = json.dumps(report, indent=1)
    print(text)
    if json_path:
        json_path.write_text(text)
    sys.exit(0 if report["ok"] else 1)


def check(url: str, out: Path, rows: int, held_at_kill: int) -> dict:
    r = redis.Redis.from_url(url, decode_responses=True)
    # NOTE: split on newlines only: generated text may hold U+2028 and the like, which JSON
    # leaves unescaped and str.splitlines() would cut at
    with out.open(encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    in_order = all(line.get("metadata", {}).get("row") == i for i, line in enumerate(lines))
    statuses: dict[str, int] = {}
    for line in lines:
        statuses[line.get("status")] = statuses.get(line.get("status"), 0) + 1
    ids = [line["id"] for line in lines]
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.llen(f"{DEFAULT_PREFIX}:done:{job_id}")
        pipe.hget(f"{DEFAULT_PREFIX}:job:{job_id}", "attempts")
    replies = pipe.execute()
    done_lengths, attempts = replies[0::2], [int(a or 0) for a in replies[1::2]]
    hashes = sum(1 for _ in r.scan_iter(f"{DEFAULT_PREFIX}:job:*", count=10_000))
    twice = sum(1 for a in attempts if a == 2)
    return {
        "one line per row, in order": dict(ok=len(lines) == rows and in_order, lines=len(lines)),
        "every row done": dict(ok=statuses == {"done": rows}, statuses=statuses),
        "one job per row, none resubmitted": dict(ok=hashes == rows and not any(line["attempt"] for line in lines),
                                                  job_hashes=hashes),
        "each job ended once": dict(ok=all(n == 1 for n in done_lengths),
                                    done_list_lengths=sorted(set(done_lengths))),
        "only jobs held at the kill ran twice": dict(ok=max(attempts) <= 2 and twice <= held_at_kill,
                                                     attempts_2=twice, attempts_max=max(attempts)),
    }


if __name__ == "__main__":
    main()
