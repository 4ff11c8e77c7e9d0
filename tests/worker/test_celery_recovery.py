"""A Celery task whose worker dies (kill -9) is taken up again within the claim time, once."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import redis

from producers.celery_app import CELERY_QUEUE, PROGRESS, TASK_NAME
from tests.worker.conftest import wait_for
from tests.worker.test_process import spawn  # noqa: F401 -- a fixture

celery = pytest.importorskip("celery")

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


class MetaLog:
    """Every state the result backend publishes for ``celery-task-meta-*``, in order, from a thread."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub()
        self.pubsub.psubscribe("celery-task-meta-*")
        self.pubsub.get_message(timeout=5)  # the subscription's confirmation
        self.states: list[tuple[str, str, object, float]] = []  # (task id, status, result, monotonic s)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message and message["type"] == "pmessage":
                meta = json.loads(message["data"])
                self.states.append((meta["task_id"], meta["status"], meta["result"], time.monotonic()))

    def of(self, task_id: str) -> list[tuple[str, object]]:
        return [(status, result) for tid, status, result, _ in list(self.states) if tid == task_id]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.pubsub.close()
        self.client.close()


def test_tasks_of_a_killed_worker_run_again_within_the_claim_time_exactly_once(spawn, start_worker,  # noqa: F811
                                                                                redis_server):
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    meta = MetaLog(redis_server)
    tasks = [app.send_task(TASK_NAME, kwargs={"prompt": f"story {i}", "sampling": LONG}, queue=CELERY_QUEUE)
             for i in range(8)]
    first = spawn("--name", "doomed", redis_url=redis_server,
                  SLUICEWAY_CLAIM_IDLE_SECONDS="2")
    wait_for(lambda: any(s[1] == PROGRESS for s in meta.states), timeout=60, what="a task to run")
    broker = redis.Redis.from_url(redis_server)
    # NOTE: killed while it may still be taking the rest: each message is taken and recorded in
    # one atomic step (worker/celery_taking.py), so every task is on the queue or unacknowledged
    first.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    assert broker.pipeline(transaction=True).llen(CELERY_QUEUE).hlen("unacked").execute() in [
        [8 - n, n] for n in range(1, 9)]  # the dead worker's tasks, unacknowledged, and the rest queued
    start_worker(claim_idle_seconds=2.0)
    results = [t.get(timeout=150) for t in tasks]  # eight generations after a restart, on a loaded CI
    assert all(r["usage"]["completion_tokens"] == 400 for r in results)
    # t.get() may see a result before the log's own subscriber thread has read its message
    wait_for(lambda: all(any(s == "SUCCESS" for s, _ in meta.of(t.id)) for t in tasks), timeout=10,
             what="every SUCCESS message on the log")
    for task in tasks:
        assert [s for s, _ in meta.of(task.id)].count("SUCCESS") == 1  # stored once: it ran to its end once
    requeued = [t.id for t in tasks if any(s == PROGRESS and r.get("requeued") for s, r in meta.of(t.id))]
    assert requeued  # those that had started were shown as queued again before they ran again
    taken_back_s = min(at for _, s, r, at in meta.states if s == PROGRESS and r.get("requeued")) - killed_at
    assert taken_back_s < 15  # the claim time (2 s) and the new worker's start, not kombu's hour
    print(f"taken back {taken_back_s:.1f}s after the kill")
    # NOTE: a message is acknowledged after its end is stored, so t.get() can return first
    wait_for(lambda: broker.pipeline(transaction=True).hlen("unacked").llen(CELERY_QUEUE).execute() == [0, 0],
             timeout=10, what="every message acknowledged and none back on the queue")
    broker.close()
    meta.close()
    app.close()


def test_a_task_whose_holder_died_after_storing_its_end_is_not_run_again(start_worker, redis_server):
    """Killed between storing the end and acknowledging (acks_late's window): the end stands and
    the entry goes. Taken back and run again, its end was stored twice, its link callbacks and
    chord part sent and counted twice (a chord body could fire before its last part ended)."""
    from producers.protocol.celery_scripts import TAKE

    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    callback = app.signature("after.generate", queue="callbacks")  # none consumes it: its messages stay there
    ended, unended = (app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"max_tokens": 4}},
                                    queue=CELERY_QUEUE, link=callback) for _ in range(2))
    app.backend.store_result(ended.id, {"stored": "by the dead holder"}, "SUCCESS")
    broker = redis.Redis.from_url(redis_server)
    take = broker.register_script(TAKE)
    for _ in range(2):  # as the dead holder took them, a minute ago
        assert take(keys=[CELERY_QUEUE, "unacked", "unacked_index"], args=[time.time() - 60])[2] == 1
    start_worker(claim_idle_seconds=2.0)
    assert unended.get(timeout=30)["usage"]["completion_tokens"] == 4  # taken back: it had not ended
    wait_for(lambda: broker.pipeline(transaction=True).hlen("unacked").llen(CELERY_QUEUE).execute() == [0, 0],
             what="both entries gone")
    assert app.AsyncResult(ended.id).result == {"stored": "by the dead holder"}
    callbacks = [json.loads(m)["headers"]["parent_id"] for m in broker.lrange("callbacks", 0, -1)]
    assert callbacks == [unended.id]  # sent once, by the one run: the ended task did not run again
    broker.close()
    app.close()
