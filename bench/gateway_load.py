"""The load side of ``sluiceway bench gateway``: many concurrent OpenAI completions requests.

Run as its own process (``python -m bench.gateway_load``) so that its HTTP work never
competes for the GIL with the worker it measures. It sends each request of a JSON file as
an OpenAI ``/v1/completions`` request -- the bytes the official SDK sends -- at most
``--concurrency`` at once, and writes what it saw as JSON: wall times, per-request
latencies, completion tokens (from ``usage``; streamed: from the last chunk's), errors.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import click


async def _one(client: Any, url: str, body: dict[str, Any], stream: bool) -> tuple[float, int, float | None]:
    """``(latency, completion tokens, time to first chunk)``; raises on any failure."""
    started = time.perf_counter()
    if not stream:
        reply = await client.post(url, json=body)
        reply.raise_for_status()
        return time.perf_counter() - started, reply.json()["usage"]["completion_tokens"], None
    tokens, first = 0, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
            if '"usage":{' in line:  # NOTE: only the last chunk is parsed: the load must stay light
                tokens = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
            elif line.startswith('data: {"error"'):
                raise RuntimeError(line)
    return time.perf_counter() - started, tokens, first


async def run_load(base_url: str, bodies: list[dict[str, Any]], concurrency: int, stream: bool,
                   api_key: str | None = None) -> dict[str, Any]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[tuple[float, int, float | None]] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=3600, headers=headers) as client:
        async def guarded(body: dict[str, Any]) -> None:
            async with gate:
                try:
                    results.append(await _one(client, "/v1/completions", body, stream))
                except Exception as exc:  # NOTE: counted and reported, never fatal for the others
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])

        started_wall, started = time.time(), time.perf_counter()
        await asyncio.gather(*(guarded(b) for b in bodies))
        seconds = time.perf_counter() - started
    return {"started_at": started_wall, "seconds": seconds, "latencies": [r[0] for r in results],
            "first_chunk": [r[2] for r in results if r[2] is not None],
            "completion_tokens": sum(r[1] for r in results), "answered": len(results), "errors": errors}


@click.command()
@click.option("--url", required=True, help="The gateway, e.g. http://127.0.0.1:8000")
@click.option("--requests", "requests_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--concurrency", type=int, default=1024, show_default=True)
@click.option("--stream/--no-stream", default=False, show_default=True)
@click.option("--api-key", default=None)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
def main(url: str, requests_path: str, concurrency: int, stream: bool, api_key: str | None, out_path: str) -> None:
    with open(requests_path) as f:
        bodies = json.load(f)
    report = asyncio.run(run_load(url, bodies, concurrency, stream, api_key))
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
