"""What an idle worker costs Redis: one blocking read per wait, not a poll every 100 ms, and a
stop that does not wait the read out."""

from __future__ import annotations

import time

import pytest
import redis

from bench.instant_engine import InstantEngine
from producers.client import Client
from producers.protocol import Keys
from tests.worker.conftest import RunningWorker, wait_for, worker_settings
from worker.loop import Worker


def blocked_readers(r: redis.Redis) -> int:
    """Clients blocked in XREADGROUP: the intake's wait.

    NOTE: not INFO's blocked_clients, which counts the Celery ingress's BRPOP (0.1 s at a time)
    too: that one alone let the window open while the intake was still reading its streams one
    by one at start (16 reads in the cluster layout), and CI counted 6 reads in the window."""
    return sum(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in r.client_list())


@pytest.mark.parametrize("shards", [0, 4], ids=["single-node layout", "cluster layout on one server"])
def test_an_idle_worker_waits_in_one_long_read_and_stops_at_once(redis_server, tmp_path, shards):
    """On the cluster layout too (4 shards on one server), one read waits on every shard's
    streams; before, it read each stream (2 queues x 4 shards) and waited 100 ms on one, ~180
    reads in 2 s."""
    r = redis.Redis.from_url(redis_server)
    settings = worker_settings(tmp_path, redis_server, name="idle", claim_idle_seconds=60.0, queue_shards=shards)
    handle = RunningWorker(Worker(settings, engine=InstantEngine()))
    try:
        wait_for(lambda: r.hexists(Keys().workers, "idle") and blocked_readers(r) == 1, what="the worker waiting")
        r.config_resetstat()
        window_s = 2.0
        time.sleep(window_s)  # NOTE: a rate is counted over a length of time
        reads = int(r.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))
        # NOTE: a wait is counted when it ends: waits of BLOCK_MS (2 s) end at most twice in a 2 s
        # window whose edges fall near their ends, and a claim round (every 5 s here) cuts one
        # short: at most 3 (CI read 3 once with the bound at 2; before the one long read, ~180)
        assert reads <= 3, f"{reads} XREADGROUP in {window_s}s from one idle worker of {shards} shards"
        with Client(redis_server, queue="bulk", queue_shards=shards) as client:  # a job still wakes it at once
            job_id = client.submit("hi", sampling={"max_tokens": 3})
            started = time.monotonic()
            assert client.result(job_id, timeout=10).usage.completion_tokens == 3
            assert time.monotonic() - started < 1.0
        wait_for(lambda: blocked_readers(r) == 1, what="the worker waiting again")
        started = time.monotonic()
        assert handle.stop() == 0
        assert time.monotonic() - started < 1.0, "a stop must not wait out the read"
    finally:
        if handle.thread.is_alive():
            handle.stop(immediately=True)
        r.close()
