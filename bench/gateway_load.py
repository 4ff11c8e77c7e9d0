"""The load side of ``sluiceway bench gateway``: many concurrent OpenAI completions requests.

Run as its own processes (``python -m bench.gateway_load``) so that their HTTP work never
competes for the GIL with the worker it measures. Each sends the requests of a JSON file as
OpenAI ``/v1/completions`` requests -- the bytes the official SDK sends -- at most
``--concurrency`` at once, and writes what it saw as JSON: when it started, when each request
had been sent whole and when it was answered (``time.monotonic()``, one clock for every
process of the host), per-request latencies, completion tokens (from ``usage``; streamed: from
the last chunk's), errors.

NOTE: one httpx client's connection pool costs more per request the more connections it holds
(each request's turn scans the pool), so one process with a thousand connections sends its
requests slowly and the engine starts on a trickle. ``run_processes`` spreads the requests over
several processes, each with its own client, all started and ready before the clock starts and
let go together (``--barrier``: each says ``ready`` on its stdout, then waits for a line on its
stdin), and ``merge`` joins their reports: the wall time runs from the earliest start to the
last answer, the ramp from the earliest start to the last request sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import click

READY = "ready"
CONNECTIONS_PER_PROCESS = 128  # the default spread: load processes of at most this many connections


async def _one(client: Any, url: str, body: dict[str, Any], stream: bool) -> tuple[float, int, float | None, float]:
    """``(latency, completion tokens, time to first chunk, when the request had been sent)``;
    raises on any failure."""
    started = time.monotonic()
    sent = [started]

    async def trace(name: str, info: dict[str, Any]) -> None:
        if name == "http11.send_request_body.complete":
            sent[0] = time.monotonic()

    options = {"extensions": {"trace": trace}}
    if not stream:
        reply = await client.post(url, json=body, **options)
        reply.raise_for_status()
        return time.monotonic() - started, reply.json()["usage"]["completion_tokens"], None, sent[0]
    tokens, first = 0, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body, **options) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
            if '"usage":{' in line:  # NOTE: only the last chunk is parsed: the load must stay light
                tokens = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
            elif line.startswith('data: {"error"'):
                raise RuntimeError(line)
    return time.monotonic() - started, tokens, first, sent[0]


async def run_load(base_url: str, bodies: list[dict[str, Any]], concurrency: int, stream: bool,
                   api_key: str | None = None, barrier: bool = False) -> dict[str, Any]:
    """Send ``bodies``; with ``barrier``, say ``ready`` on stdout once the client is built and
    start when a line arrives on stdin."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[tuple[float, int, float | None, float]] = []
    answered_at: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=3600, headers=headers) as client:
        async def guarded(body: dict[str, Any]) -> None:
            async with gate:
                try:
                    results.append(await _one(client, "/v1/completions", body, stream))
                except Exception as exc:  # NOTE: counted and reported, never fatal for the others
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                answered_at.append(time.monotonic())

        if barrier:
            print(READY, flush=True)
            sys.stdin.readline()  # NOTE: blocking is fine: nothing else runs in this loop yet
        started_wall, started, cpu = time.time(), time.monotonic(), time.process_time()
        await asyncio.gather(*(guarded(b) for b in bodies))
        ended, cpu = time.monotonic(), time.process_time() - cpu
    return {"started_at": started_wall, "started": started, "ended": ended, "seconds": ended - started,
            "cpu_s": cpu,
            "latencies": [r[0] for r in results], "first_chunk": [r[2] for r in results if r[2] is not None],
            "sent": [r[3] for r in results], "answered_at": answered_at,
            "completion_tokens": sum(r[1] for r in results), "answered": len(results), "errors": errors}


def default_processes(concurrency: int) -> int:
    return max(1, -(-concurrency // CONNECTIONS_PER_PROCESS))


def run_processes(url: str, bodies: list[dict[str, Any]], concurrency: int, stream: bool, processes: int,
                  workdir: str) -> dict[str, Any]:
    """``bodies`` over ``processes`` load processes (round robin, ``concurrency`` shared out),
    released together once all are ready; their reports merged (``merge``)."""
    processes = max(1, min(processes, len(bodies)))
    children, outs = [], []
    try:
        for i in range(processes):
            share = concurrency // processes + (1 if i < concurrency % processes else 0)
            requests_path = os.path.join(workdir, f"requests-{i}.json")
            outs.append(os.path.join(workdir, f"out-{i}.json"))
            with open(requests_path, "w") as f:
                json.dump(bodies[i::processes], f)
            command = [sys.executable, "-m", "bench.gateway_load", "--url", url, "--requests", requests_path,
                       "--concurrency", str(max(1, share)), "--out", outs[-1], "--barrier",
                       "--stream" if stream else "--no-stream"]
            children.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for child in children:
            line = child.stdout.readline().strip()
            if line != READY:
                raise RuntimeError(f"a load process did not get ready (it said {line[:200]!r})")
        for child in children:  # the barrier: every process is waiting on its stdin
            child.stdin.write("go\n")
            child.stdin.flush()
        for child in children:
            if child.wait() != 0:
                raise RuntimeError(f"a load process failed (exit code {child.returncode})")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    reports = []
    for path in outs:
        with open(path) as f:
            reports.append(json.load(f))
    return merge(reports)


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several load processes': wall time from the earliest start to the last
    answer; ``ramp_s``, from the earliest start to the last request sent whole, and the time
    by which half the requests had been sent (``sent_p50_s``); ``cpu_s``, the CPU seconds the
    processes spent from their start on."""
    start = min(r["started"] for r in reports)
    end = max(r["ended"] for r in reports)
    sent = sorted(t - start for r in reports for t in r["sent"])
    merged: dict[str, Any] = {"started_at": min(r["started_at"] for r in reports), "seconds": end - start,
                              "processes": len(reports),
                              "ramp_s": round(sent[-1], 4) if sent else None,
                              "sent_p50_s": round(sent[len(sent) // 2], 4) if sent else None,
                              "start_spread_s": round(max(r["started"] for r in reports) - start, 4)}
    for name in ("latencies", "first_chunk", "errors"):
        merged[name] = [v for r in reports for v in r[name]]
    for name in ("completion_tokens", "answered"):
        merged[name] = sum(r[name] for r in reports)
    merged["cpu_s"] = round(sum(r["cpu_s"] for r in reports), 3)  # from the start, imports left out
    return merged


@click.command()
@click.option("--url", required=True, help="The gateway, e.g. http://127.0.0.1:8000")
@click.option("--requests", "requests_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--concurrency", type=int, default=1024, show_default=True)
@click.option("--stream/--no-stream", default=False, show_default=True)
@click.option("--api-key", default=None)
@click.option("--barrier", is_flag=True, help="Say 'ready' on stdout, then start at a line on stdin.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
def main(url: str, requests_path: str, concurrency: int, stream: bool, api_key: str | None, barrier: bool,
         out_path: str) -> None:
    with open(requests_path) as f:
        bodies = json.load(f)
    report = asyncio.run(run_load(url, bodies, concurrency, stream, api_key, barrier))
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
