"""A Celery message is taken off the broker and recorded in ``unacked`` in one atomic step
(``worker/celery_taking.py``): no moment when a worker killed leaves it in neither list."""

from __future__ import annotations

import json
import threading

import pytest
import redis

from producers.celery_app import CELERY_QUEUE, TASK_NAME
from tests.worker.conftest import wait_for
from producers.protocol.celery_scripts import TAKE

celery = pytest.importorskip("celery")
kombu = pytest.importorskip("kombu")

GREEDY = {"temperature": 0, "max_tokens": 4}
SEP = "\x06\x16"  # kombu's separator of a queue's priority keys


def send(url: str, n: int, **options) -> list[str]:
    app = celery.Celery("app", broker=url, backend=url)
    ids = [app.send_task(TASK_NAME, kwargs={"prompt": f"task {i}", "sampling": GREEDY}, queue=CELERY_QUEUE,
                         **options).id for i in range(n)]
    app.close()
    return ids


def test_the_script_takes_the_oldest_message_and_records_it_as_kombu_does(redis_server):
    """The unacked entry is what kombu's ``QoS.append`` writes ([message, exchange, routing key])
    and the index holds its tag; the base key before the priority keys; nothing on an empty queue."""
    client = redis.Redis.from_url(redis_server)
    client.delete(CELERY_QUEUE, "unacked", "unacked_index")
    first, second = send(redis_server, 2)
    urgent, = send(redis_server, 1, priority=3)  # kombu's key for priority 3
    keys = [CELERY_QUEUE, *(f"{CELERY_QUEUE}{SEP}{p}" for p in (3, 6, 9))]
    assert client.llen(keys[1]) == 1
    take = client.register_script(TAKE)
    taken = []
    for _ in range(3):
        key, raw, recorded = take(keys=[*keys, "unacked", "unacked_index"], args=[1234.5])
        message = json.loads(raw)
        assert recorded == 1
        tag = message["properties"]["delivery_tag"]
        info = message["properties"]["delivery_info"]
        assert json.loads(client.hget("unacked", tag)) == [message, info["exchange"], info["routing_key"]]
        assert client.zscore("unacked_index", tag) == 1234.5
        taken.append((key.decode(), message["headers"]["id"]))
    assert taken == [(CELERY_QUEUE, first), (CELERY_QUEUE, second), (keys[1], urgent)]
    assert take(keys=[*keys, "unacked", "unacked_index"], args=[0]) is None
    assert client.hlen("unacked") == 3 and not any(client.llen(k) for k in keys)
    client.close()


def test_the_wait_leaves_the_queue_as_it_was(redis_server):
    """``BLMOVE q q RIGHT RIGHT`` (what the channel blocks on) returns once the queue holds a
    message and takes nothing: a worker killed after it loses nothing."""
    client = redis.Redis.from_url(redis_server)
    client.delete(CELERY_QUEUE)
    ids = send(redis_server, 3)
    before = client.lrange(CELERY_QUEUE, 0, -1)
    assert client.blmove(CELERY_QUEUE, CELERY_QUEUE, 1, "RIGHT", "RIGHT") == before[-1]
    assert client.lrange(CELERY_QUEUE, 0, -1) == before
    assert [json.loads(raw)["headers"]["id"] for raw in reversed(before)] == ids  # the oldest on the right
    client.delete(CELERY_QUEUE)
    client.close()


def test_the_worker_takes_every_message_by_the_script(start_worker, redis_server):
    """Through a running worker, watched with MONITOR: every pop of the Celery queue and every
    write of its unacked entry happens inside the script (with kombu's consumer each is a
    command of its own, outside any script), and every task still ends with its result."""
    client = redis.Redis.from_url(redis_server)
    client.delete(CELERY_QUEUE, "unacked", "unacked_index")
    seen: list[str] = []
    ready = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        with client.monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                text = command["command"]
                name = text.split(" ", 1)[0].upper()
                if (CELERY_QUEUE in text and name in ("BRPOP", "RPOP", "BLMOVE", "LMPOP")) or (
                        name == "HSET" and text.split(" ")[1] == "unacked"):
                    seen.append(f"{command.get('client_type', '')} {text[:60]}")
                if stop.is_set():
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert ready.wait(5)
    running = start_worker()
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    tasks = [app.send_task(TASK_NAME, kwargs={"prompt": f"task {i}", "sampling": GREEDY}, queue=CELERY_QUEUE)
             for i in range(4)]
    results = [task.get(timeout=60) for task in tasks]
    assert all(r["usage"]["completion_tokens"] == 4 for r in results)
    wait_for(lambda: client.hlen("unacked") == 0, timeout=10, what="every message acknowledged")
    stop.set()
    client.lpush("unrelated", "x")  # one more command, so the watcher's loop sees the stop
    watcher.join(5)
    pops = [s for s in seen if "RPOP" in s.upper()]
    assert len(pops) >= 4, seen
    assert all(s.startswith("lua") for s in pops), seen  # popped only inside the script
    assert not [s for s in seen if "BRPOP" in s.upper()], seen
    records = [s for s in seen if " HSET " in f" {s.upper()}"]
    assert len(records) >= 4 and all(s.startswith("lua") for s in records), seen  # kombu's own write left out
    running.stop()
    app.close()
    client.delete("unrelated")
    client.close()
