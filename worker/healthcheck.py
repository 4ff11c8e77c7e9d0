"""``python -m worker.healthcheck``: exit 0 if this host's worker makes progress.

Reads the worker's own metrics endpoint (``SLUICEWAY_METRICS_PORT``) and checks, with a
limit of ``SLUICEWAY_HEALTH_MAX_AGE`` seconds (default 60):

- the step loop turned within the limit: a loop stuck in a step, or a process that lost its
  engine, fails the check;
- the result writer stored something within the limit, or has nothing waiting: a writer
  that cannot write (Redis away or refusing writes for that long, or any other wedge) while
  results wait fails the check.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request

LOOP_METRIC = "sluiceway_worker_loop_timestamp_seconds"
WRITER_PROGRESS_METRIC = "sluiceway_writer_progress_timestamp_seconds"
WRITER_UNWRITTEN_METRIC = "sluiceway_writer_unwritten"


def _samples(body: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page, by name."""
    found = {}
    for line in body.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                found[name] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return found


def check(port: int, max_age: float, host: str = "127.0.0.1") -> str | None:
    """None when healthy, else why not."""
    try:
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    except OSError as exc:
        return f"no metrics endpoint on port {port}: {exc}"
    samples = _samples(body)
    now = time.time()
    if LOOP_METRIC not in samples:
        return f"{LOOP_METRIC} missing from the metrics"
    age = now - samples[LOOP_METRIC]
    if age > max_age:
        return f"the step loop last turned {age:.0f}s ago (limit {max_age:.0f}s)"
    unwritten = samples.get(WRITER_UNWRITTEN_METRIC, 0.0)
    progress = samples.get(WRITER_PROGRESS_METRIC)
    if unwritten > 0 and progress is not None and now - progress > max_age:
        return (f"the result writer has stored nothing for {now - progress:.0f}s with {unwritten:.0f} writes"
                f" waiting (limit {max_age:.0f}s)")
    return None


def main() -> None:
    port = os.environ.get("SLUICEWAY_METRICS_PORT")
    if not port:
        sys.exit("SLUICEWAY_METRICS_PORT is not set: the health check reads the worker's metrics endpoint")
    problem = check(int(port), float(os.environ.get("SLUICEWAY_HEALTH_MAX_AGE", "60")))
    if problem:
        sys.exit(f"unhealthy: {problem}")


if __name__ == "__main__":
    main()
