"""``python -m worker.healthcheck``: exit 0 if this host's worker loop turned recently.

Reads the worker's own metrics endpoint (``SLUICEWAY_METRICS_PORT``) and checks that the
step loop's last turn is at most ``SLUICEWAY_HEALTH_MAX_AGE`` seconds old (default 60): a
loop stuck in a step, or a process that lost its engine, fails the check.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request

LOOP_METRIC = "sluiceway_worker_loop_timestamp_seconds"


def check(port: int, max_age: float, host: str = "127.0.0.1") -> str | None:
    """None when healthy, else why not."""
    try:
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    except OSError as exc:
        return f"no metrics endpoint on port {port}: {exc}"
    for line in body.splitlines():
        if line.startswith(LOOP_METRIC + " "):
            age = time.time() - float(line.split()[1])
            return None if age <= max_age else f"the step loop last turned {age:.0f}s ago (limit {max_age:.0f}s)"
    return f"{LOOP_METRIC} missing from the metrics"


def main() -> None:
    port = os.environ.get("SLUICEWAY_METRICS_PORT")
    if not port:
        sys.exit("SLUICEWAY_METRICS_PORT is not set: the health check reads the worker's metrics endpoint")
    problem = check(int(port), float(os.environ.get("SLUICEWAY_HEALTH_MAX_AGE", "60")))
    if problem:
        sys.exit(f"unhealthy: {problem}")


if __name__ == "__main__":
    main()
