"""Celery's meaning of a task's options on the GPU worker: expires, countdown / eta, time
limits, result_expires, any task id, and failures that rebuild in any process."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis

from producers.celery_app import CELERY_QUEUE, TASK_NAME, TaskFailed
from tests.worker.conftest import SlowEngine, wait_for
from worker.celery_tasks import job_id as celery_job_id

celery = pytest.importorskip("celery")

GREEDY = {"temperature": 0, "max_tokens": 4}
LONG = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def app(redis_server):
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    yield app
    app.close()


def send(app, sampling=GREEDY, prompt="Hello", **options):
    return app.send_task(TASK_NAME, kwargs={"prompt": prompt, "sampling": sampling}, queue=CELERY_QUEUE, **options)


def test_expires_revokes_a_task_not_started_and_never_stops_a_running_one(start_worker, engine, app):
    gone = send(app, expires=datetime.now(timezone.utc) - timedelta(seconds=5))
    running = send(app, sampling=LONG, expires=0.5)  # seconds from now
    start_worker(SlowEngine(engine, step_s=0.01))
    with pytest.raises(celery.exceptions.TaskRevokedError, match="expired"):
        gone.get(timeout=20)
    assert gone.state == "REVOKED"
    assert running.get(timeout=60)["usage"]["completion_tokens"] == 200  # ran past its expires


def test_countdown_waits_outside_the_engine_and_then_runs(start_worker, app, redis_server):
    handle = start_worker()
    sent = time.time()
    later = send(app, countdown=1.5)
    broker = redis.Redis.from_url(redis_server)
    wait_for(lambda: broker.hlen("unacked") == 1, what="the task to be read")  # taken, not acknowledged
    broker.close()
    assert len(handle.worker.held) == 0 and later.state == "PENDING"  # no engine slot, not started
    now = send(app)  # the engine is free for others meanwhile
    assert now.get(timeout=20)["usage"]["completion_tokens"] == 4
    assert later.get(timeout=20)["usage"]["completion_tokens"] == 4
    assert later.date_done.timestamp() >= sent + 1.5


def test_time_limits_end_a_running_generation_as_celery_does(start_worker, engine, app):
    hard = send(app, sampling=LONG, time_limit=0.3)
    soft = send(app, sampling=LONG, soft_time_limit=0.3, time_limit=60)
    start_worker(SlowEngine(engine, step_s=0.01))
    with pytest.raises(celery.exceptions.TimeLimitExceeded, match="time_limit"):
        hard.get(timeout=20)
    with pytest.raises(celery.exceptions.SoftTimeLimitExceeded, match="soft_time_limit"):
        soft.get(timeout=20)


def test_results_live_result_ttl_and_any_task_id_runs(start_worker, app, redis_server):
    start_worker(result_ttl=77)
    odd = "my grading run/row 17 ü " + "x" * 200  # no protocol id: space, slash, non-ASCII, 200+ characters
    res = send(app, task_id=odd)
    assert res.get(timeout=20)["usage"]["completion_tokens"] == 4
    assert app.AsyncResult(odd).state == "SUCCESS"
    db = redis.Redis.from_url(redis_server)
    assert 0 < db.ttl(f"celery-task-meta-{odd}") <= 77
    newline = send(app, task_id="row-17\n")  # no protocol id either: a regex's '$' had taken it for one
    assert newline.get(timeout=20)["id"] == celery_job_id("row-17\n") != "row-17\n"
    revoked = send(app, task_id="another one/ü", countdown=30)
    revoked.revoke()
    with pytest.raises(celery.exceptions.TaskRevokedError):
        revoked.get(timeout=40)
    db.close()


def test_celery_config_is_loaded_and_result_ttl_applies_unless_it_sets_result_expires(tiny_model, engine,
                                                                                      redis_server):
    from tests.worker.conftest import worker_settings
    from worker.loop import Worker

    worker = Worker(worker_settings(tiny_model, redis_server, result_ttl=77,
                                    celery_config="tests.worker.celery_callbacks:config"), engine=engine)
    try:
        conf = worker.celery.app.conf
        assert conf.result_expires == 77 and conf.result_extended is True and "canvas.*" in conf.task_routes
    finally:
        worker.shutdown()
    with pytest.raises(ValueError, match="celery_config: cannot load 'no_such_module:config'"):
        Worker(worker_settings(tiny_model, redis_server, celery_config="no_such_module:config"), engine=engine)


def test_a_failure_has_a_traceback_and_its_text_in_a_process_without_sluiceway(start_worker, app, redis_server):
    start_worker()
    failed = send(app, prompt="x", sampling={"max_tokens": -3})
    with pytest.raises(TaskFailed, match="max_tokens") as raised:
        failed.get(timeout=20)
    assert raised.value.error_code == "invalid_job" and raised.value.job_id == failed.id
    assert "TaskFailed" in failed.traceback and "max_tokens" in failed.traceback
    # A process that has only celery: the exception is rebuilt under its name with its text.
    code = (f"import sys, celery; app = celery.Celery(broker={redis_server!r}, backend={redis_server!r}); "
            f"r = app.AsyncResult({failed.id!r}); exc = r.result; "
            "assert 'producers' not in sys.modules; print(type(exc).__name__, '|', exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    name, text = out.strip().split(" | ", 1)
    assert name == "TaskFailed" and text.startswith(f"task {failed.id} failed [invalid_job]: ") and "max_tokens" in text


def test_ignore_result_stores_no_state_of_the_task_as_with_a_celery_worker(start_worker, engine, app, redis_server):
    """Neither its PROGRESS nor its end: a task sent with ``ignore_result=True`` was left PROGRESS
    (its success unstored over its last partial text) until the result expired."""
    start_worker(SlowEngine(engine, step_s=0.01))
    ran = send(app, sampling={"temperature": 0, "max_tokens": 60, "ignore_eos": True}, ignore_result=True)
    failed = send(app, sampling={"max_tokens": -3}, ignore_result=True)
    waiting = send(app, countdown=30, ignore_result=True)
    broker = redis.Redis.from_url(redis_server)
    wait_for(lambda: broker.pipeline().llen(CELERY_QUEUE).hlen("unacked").execute() == [0, 1],
             what="all three taken, two ended (acknowledged), the countdown waiting")
    waiting.revoke()
    wait_for(lambda: broker.hlen("unacked") == 0, what="the revoked task to end")
    assert broker.exists(*(f"celery-task-meta-{t.id}" for t in (ran, failed, waiting))) == 0
    assert send(app).get(timeout=20)["usage"]["completion_tokens"] == 4  # without it, stored as ever
    broker.close()
