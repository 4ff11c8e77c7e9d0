"""The backlog monitor's share of the waiting jobs: each queue's split among the live workers
that read it, whose heartbeats it reads as every producer reads them (``producers.heartbeats``)."""

from __future__ import annotations

import json
import time

import pytest

from producers.heartbeats import read_fleet
from producers.protocol import Keys, WorkerInfo
from worker.admission import Held
from worker.backlog import BacklogMonitor, CeleryQueueDepth
from worker.metrics import Metrics

KEYS = Keys()


def record(name: str, *, state: str = "running", alive: bool = True,
           queues: tuple[str, ...] = ("interactive",), celery_queue: str | None = None) -> str:
    seen = time.time() - (0 if alive else 3600)
    return WorkerInfo(name=name, host="h", pid=1, queues=list(queues), model="tiny", state=state,
                      started_at=seen, last_seen=seen, stale_after_s=30,
                      celery_queue=celery_queue).model_dump_json()


def old_record(name: str, **kwargs) -> str:
    """A heartbeat as a worker from before ``celery_queue`` writes it: without the field."""
    found = json.loads(record(name, **kwargs))
    del found["celery_queue"]
    return json.dumps(found)


def put_celery_tasks(redis_server: str, n: int, queue: str = "sluiceway") -> None:
    kombu = pytest.importorskip("kombu")
    with kombu.Connection(redis_server) as conn:
        tasks = conn.SimpleQueue(queue)
        for i in range(n):
            tasks.put({"task": i})
        tasks.close()


def read(client, queues: tuple[str, ...], celery: CeleryQueueDepth | None = None) -> BacklogMonitor:
    monitor = BacklogMonitor(client, KEYS, queues, Held(), Metrics(), celery=celery)
    monitor.tick()
    return monitor


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


def two_models(client, waiting: dict[str, int]) -> None:
    """Model A's workers read queue a, model B's queue b, and one worker reads both."""
    client.hset(KEYS.workers, mapping={
        "a1": record("a1", queues=("a",)), "a2": record("a2", queues=("a",)),
        "ab": record("ab", queues=("a", "b", "a")),  # a queue named twice is one reader
        "b1": record("b1", queues=("b",)), "b-leaving": record("b-leaving", state="draining", queues=("b",))})
    for queue, n in waiting.items():
        for i in range(n):
            client.xadd(KEYS.queue(queue), {"job": f"{queue}-{i}"})


def test_each_queues_waiting_jobs_are_shared_among_the_live_workers_that_read_it(redis_client):
    """Two models on queues of their own, and a worker of both: a queue's waiting jobs are split
    among its own live readers, the parts of a worker's queues added up before rounding up."""
    two_models(redis_client, {"a": 4, "b": 3, "c": 2})
    assert read(redis_client, ("b",)).share() == 2  # 3 / 2; was 1: 3 / 4 live workers
    assert read(redis_client, ("a", "b")).share() == 3  # 4 / 3 + 3 / 2; was 2: 7 / 4
    assert read(redis_client, ("c",)).share() == 2  # no live reader yet but this worker; was 1: 2 / 4


def test_the_celery_queues_tasks_are_shared_among_every_live_worker(redis_client, redis_server):
    """No live heartbeat names a Celery queue: its tasks are split among the whole live fleet, as
    before the heartbeats said who consumes them."""
    kombu = pytest.importorskip("kombu")
    two_models(redis_client, {"a": 4})
    with kombu.Connection(redis_server) as conn:
        tasks = conn.SimpleQueue("sluiceway")
        for i in range(6):
            tasks.put({"task": i})
        tasks.close()
    monitor = read(redis_client, ("a",), CeleryQueueDepth(redis_client, "sluiceway"))
    assert monitor.depth() == {"a": (4, 0), "celery:sluiceway": (6, 0)}
    assert monitor.share() == 3  # 4 / 3 + 6 / 4 live workers (not 6 / 3, a's readers: 4), as before


def test_the_celery_queues_tasks_are_shared_among_the_live_workers_that_name_it(redis_client, redis_server):
    """Of two live workers only one says it consumes the Celery queue (``celery_queue``): its six
    waiting tasks are all that one's. A draining worker of that queue, a dead one and a live one
    of another Celery queue take none of them."""
    redis_client.hset(KEYS.workers, mapping={
        "consumer": record("consumer", queues=("a",), celery_queue="sluiceway"),
        "streams-only": record("streams-only", queues=("a",)),
        "leaving": record("leaving", state="draining", celery_queue="sluiceway"),
        "gone": record("gone", alive=False, celery_queue="sluiceway"),
        "other": record("other", queues=("b",), celery_queue="other-tasks")})
    put_celery_tasks(redis_server, 6)
    monitor = read(redis_client, ("a",), CeleryQueueDepth(redis_client, "sluiceway"))
    assert monitor.depth() == {"a": (0, 0), "celery:sluiceway": (6, 0)}
    assert monitor.share() == 6  # 6 / 1; was 2: 6 / 3 live workers


def test_a_fleet_whose_heartbeats_do_not_name_a_celery_queue_shares_its_tasks_among_all_live_workers(
        redis_client, redis_server):
    """Workers from before ``celery_queue`` do not say whether they consume Celery: the tasks are
    split among every live worker, as before. A record that names the queue and is not live
    (draining) does not make the fleet one that says."""
    redis_client.hset(KEYS.workers, mapping={
        "w1": old_record("w1", queues=("a",)), "w2": old_record("w2", queues=("b",)),
        "leaving": record("leaving", state="draining", celery_queue="sluiceway")})
    assert [w.info.celery_queue for w in read_fleet(redis_client.hgetall(KEYS.workers)).workers] == [
        "sluiceway", None, None]  # an old record still reads
    put_celery_tasks(redis_server, 6)
    monitor = read(redis_client, ("a",), CeleryQueueDepth(redis_client, "sluiceway"))
    assert monitor.share() == 3  # 6 / 2 live workers, not 6 / 1
