"""The backlog monitor's share of the waiting jobs: split among the live workers, whose
heartbeats it reads as every producer reads them (``producers.heartbeats``)."""

from __future__ import annotations

import time

from producers.heartbeats import read_fleet
from producers.protocol import Keys, WorkerInfo
from worker.admission import Held
from worker.backlog import BacklogMonitor
from worker.metrics import Metrics

KEYS = Keys()


def record(name: str, *, state: str = "running", alive: bool = True) -> str:
    seen = time.time() - (0 if alive else 3600)
    return WorkerInfo(name=name, host="h", pid=1, queues=["interactive"], model="tiny", state=state,
                      started_at=seen, last_seen=seen, stale_after_s=30).model_dump_json()


def test_the_waiting_jobs_are_shared_among_the_live_workers_alone(redis_client):
    """A draining worker takes no more jobs, a dead one none at all, and a record that is no
    heartbeat is no worker's: of six waiting jobs, each of the two live workers has three.
    (``redis_client`` returns bytes, as the worker's own client does.)"""
    redis_client.hset(KEYS.workers, mapping={"w1": record("w1"), "w2": record("w2"),
                                             "leaving": record("leaving", state="draining"),
                                             "gone": record("gone", alive=False), "junk": "not a heartbeat"})
    for i in range(6):
        redis_client.xadd(KEYS.queue("interactive"), {"job": f"job-{i}"})
    monitor = BacklogMonitor(redis_client, KEYS, ("interactive",), Held(), Metrics())
    monitor.tick()
    assert monitor.depth() == {"interactive": (6, 0)}
    assert monitor.share() == 3  # was 2: the draining worker took a third of them
    assert read_fleet(redis_client.hgetall(KEYS.workers)).unreadable == ["junk"]  # named as str from bytes too
