"""Celery's tools see the GPU worker: ``celery inspect`` gets replies, an event receiver gets task events."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from producers.celery_app import CELERY_QUEUE, TASK_NAME
from tests.worker.conftest import SlowEngine, wait_for

celery = pytest.importorskip("celery")

NODE = "sluiceway@w1"  # the node of the worker named w1
LONG = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}


def test_celery_inspect_gets_replies_from_the_gpu_worker(start_worker, engine, redis_server_factory):
    server = redis_server_factory(password="s3cret")  # a secret that conf and report must not show
    redis_server = f"redis://:s3cret@{server.host}:{server.port}/0"
    start_worker(SlowEngine(engine, step_s=0.01), url=redis_server)
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    running = app.send_task(TASK_NAME, kwargs={"prompt": "long", "sampling": LONG}, queue=CELERY_QUEUE)
    later = app.send_task(TASK_NAME, kwargs={"prompt": "later", "sampling": LONG}, queue=CELERY_QUEUE, countdown=60)
    wait_for(lambda: running.state == "PROGRESS", what="the task to run")
    inspect = app.control.inspect(destination=[NODE], timeout=2)
    assert inspect.ping() == {NODE: {"ok": "pong"}}
    assert [t["id"] for t in inspect.active()[NODE]] == [running.id]
    assert [t["request"]["id"] for t in inspect.scheduled()[NODE]] == [later.id]
    stats = inspect.stats()[NODE]
    assert stats["pid"] > 0 and stats["total"] == {TASK_NAME: 0} and stats["pool"]["max-concurrency"] > 0
    assert [q["name"] for q in inspect.active_queues()[NODE]] == [CELERY_QUEUE]
    # The celery command line, as a health check would run it.
    out = subprocess.run([sys.executable, "-m", "celery", "-b", redis_server, "inspect", "ping", "-d", NODE],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "pong" in out.stdout
    assert inspect.registered() == {NODE: [TASK_NAME]}  # Flower's worker page asks (was an error reply)
    assert inspect.revoked() == {NODE: []}
    # conf (Flower's worker page asks for it too), query_task and report were error replies
    conf = inspect.conf()[NODE]
    assert conf["broker_url"] == f"redis://:********@{server.host}:{server.port}/0"
    assert conf["accept_content"] == ["json"] and "s3cret" not in json.dumps(conf)
    assert "s3cret" not in json.dumps(inspect.conf(with_defaults=True)[NODE])
    states = inspect.query_task(running.id, later.id, "unknown")[NODE]
    assert {task_id: (state, info["id"]) for task_id, (state, info) in states.items()} == {
        running.id: ("active", running.id), later.id: ("scheduled", later.id)}
    report = inspect.report()[NODE]["ok"]
    assert NODE in report and "accept_content: ['json']" in report and "s3cret" not in report
    out = subprocess.run([sys.executable, "-m", "celery", "-b", redis_server, "inspect", "query_task", running.id,
                          "-d", NODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"active"' in out.stdout, out.stdout + out.stderr
    app.control.revoke([running.id, later.id])
    with pytest.raises(celery.exceptions.TaskRevokedError):
        running.get(timeout=20)
    assert sorted(inspect.revoked()[NODE]) == sorted([running.id, later.id])
    app.close()


def test_task_events_reach_an_event_receiver(start_worker, redis_server):
    start_worker(celery_config="tests.worker.celery_callbacks:events_config")
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    seen: list[dict] = []
    ready = threading.Event()
    conn = app.connection_for_read()
    receiver = app.events.Receiver(conn, handlers={"*": seen.append})
    receiver.on_consume_ready = lambda *args, **kwargs: ready.set()  # its queue is bound: nothing sent is missed
    thread = threading.Thread(target=receiver.capture, kwargs={"wakeup": False}, daemon=True)
    thread.start()
    assert ready.wait(10)
    ok = app.send_task(TASK_NAME, kwargs={"prompt": "Hello", "sampling": {"max_tokens": 4}}, queue=CELERY_QUEUE)
    bad = app.send_task(TASK_NAME, kwargs={"prompt_token_ids": [1] * 600, "sampling": {"max_tokens": 4}},
                        queue=CELERY_QUEUE)
    refused = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"max_tokens": -1}}, queue=CELERY_QUEUE)
    ok.get(timeout=20)
    with pytest.raises(Exception):
        bad.get(timeout=20)

    def kinds(task_id):
        return [e["type"] for e in list(seen) if e.get("uuid") == task_id]

    wait_for(lambda: "task-succeeded" in kinds(ok.id) and "task-failed" in kinds(bad.id)
             and "task-failed" in kinds(refused.id), what="the tasks' events")
    assert kinds(ok.id) == ["task-received", "task-started", "task-succeeded"]
    assert kinds(bad.id)[0] == "task-received" and kinds(bad.id)[-1] == "task-failed"
    assert any(e["type"] == "worker-heartbeat" or e["type"] == "worker-online" for e in seen)
    receiver.should_stop = True
    thread.join(10)
    conn.release()
    app.close()


def test_conf_masks_every_password_and_secret_a_setting_holds():
    """Celery's own filter (app.conf.table()) leaves result_backend's ?password= as it is, and
    masks URLs only in settings it knows to hold one."""
    from worker.celery_control import censored

    settings = {"broker_read_url": "sentinel://:a1@h1:26379/0;sentinel://u:a2@h2:26379/0",
                "result_backend": "redis://h:6379/0?password=a3&ssl_cert_reqs=required",
                "broker_transport_options": {"master_name": "m", "sentinel_kwargs": {"password": "a4"}},
                "my_api_token": "a5", "flower_url": "http://admin:a6@flower:5555/",
                "task_routes": {"a.*": {"queue": "cpu"}}}
    shown = censored(settings)
    assert not any(f"a{i}" in json.dumps(shown) for i in range(1, 7)), shown
    assert shown["broker_read_url"] == "sentinel://:********@h1:26379/0;sentinel://u:********@h2:26379/0"
    assert shown["result_backend"] == "redis://h:6379/0?password=********&ssl_cert_reqs=required"
    assert shown["task_routes"] == settings["task_routes"]
