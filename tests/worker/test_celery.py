"""The Celery ingress as the worker wires it: on by default, on the worker's own Redis, in the backlog."""

from __future__ import annotations

import os
import sys
import time

import pytest
import redis
from click.testing import CliRunner

from producers.celery_app import CELERY_QUEUE, TASK_NAME, generate_signature
from tests.worker.conftest import SlowEngine, wait_for, worker_settings
from worker.celery_tasks import broker_redis_url, celery_url
from worker.cli import load_settings, worker_command
from worker.loop import Worker
from worker.settings import WorkerSettings

celery = pytest.importorskip("celery")
kombu = pytest.importorskip("kombu")

GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture
def idle_worker(tiny_model, engine):
    """``idle_worker(url, **settings)``: a wired ``Worker`` that is never started, so nothing consumes."""
    made: list[Worker] = []

    def make(url: str, **overrides) -> Worker:
        worker = Worker(worker_settings(tiny_model, url, **overrides), engine=engine)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def send(url: str, n: int, queue: str = CELERY_QUEUE, **options) -> None:
    app = celery.Celery("app", broker=url, backend=url)
    for i in range(n):
        app.send_task(TASK_NAME, kwargs={"prompt": f"task {i}", "sampling": GREEDY}, queue=queue, **options)
    app.close()


def gauge(worker: Worker, name: str, queue: str) -> float | None:
    return worker.metrics.registry.get_sample_value(name, {"queue": queue})


def test_celery_is_on_by_default_and_can_be_turned_off(monkeypatch):
    for name in [n for n in os.environ if n.startswith("SLUICEWAY_")]:
        monkeypatch.delenv(name)
    assert WorkerSettings(model="m").celery is True
    monkeypatch.setenv("SLUICEWAY_CELERY", "false")
    assert WorkerSettings(model="m").celery is False
    assert load_settings({"model": "m", "celery": True}).celery is True  # a flag wins over the environment
    help_text = CliRunner().invoke(worker_command, ["--help"]).output
    assert "--celery / --no-celery" in help_text and "SLUICEWAY_CELERY]" in help_text


def test_celery_urls_are_the_worker_redis_urls_in_celery_spelling():
    assert celery_url("redis://:pw@host:6379/2") == "redis://:pw@host:6379/2"
    assert celery_url("unix:///run/redis.sock") == "redis+socket:///run/redis.sock"
    assert celery_url("unix://:pw@/run/redis.sock?db=3") == "redis+socket://:pw@/run/redis.sock?virtual_host=3"
    assert celery_url("rediss://host:6380/0") == "rediss://host:6380/0?ssl_cert_reqs=required"
    assert celery_url("rediss://host/0?ssl_cert_reqs=none") == "rediss://host/0?ssl_cert_reqs=none"
    for url in ("redis://host:6379/2", "unix://:pw@/run/redis.sock?db=3"):
        assert broker_redis_url(celery_url(url)) == url


def test_tasks_no_worker_consumes_count_in_the_backlog_and_its_metrics(idle_worker, redis_server):
    worker = idle_worker(redis_server)
    send(redis_server, 4)
    send(redis_server, 2, priority=9)  # kombu keeps higher priorities in lists of their own
    worker.backlog.tick()
    assert worker.backlog.depth()["celery:sluiceway"] == (6, 0)
    assert gauge(worker, "sluiceway_queue_depth", "celery:sluiceway") == 6
    assert gauge(worker, "sluiceway_queue_pending", "celery:sluiceway") == 0
    assert worker.backlog.share() == 6  # what the swap pool is sized from

    # Taken by a consumer and not yet acknowledged: pending. Another queue's unacked task is not ours.
    send(redis_server, 1, queue="other")
    with kombu.Connection(celery_url(redis_server)) as conn:
        channel = conn.channel()
        taken = [channel.basic_get(q, no_ack=False) for q in (CELERY_QUEUE, CELERY_QUEUE, "other")]
        assert all(m is not None for m in taken)
        worker.backlog.tick()
        assert worker.backlog.depth()["celery:sluiceway"] == (4, 2)
        assert gauge(worker, "sluiceway_queue_pending", "celery:sluiceway") == 2
        assert worker.backlog.share() == 4
        channel.close()  # gives the unacknowledged tasks back to their queues
    worker.backlog.tick()
    assert worker.backlog.depth()["celery:sluiceway"] == (6, 0)


def test_a_celery_broker_of_its_own_is_read_for_the_backlog(idle_worker, redis_server, redis_server_factory):
    broker = redis_server_factory(unix_socket=True)
    worker = idle_worker(redis_server, celery_broker=celery_url(broker.url + "?db=2"))
    send(celery_url(broker.url + "?db=2"), 3)
    send(redis_server, 5)  # the worker's own Redis is not its broker now
    worker.backlog.tick()
    assert worker.backlog.depth()["celery:sluiceway"] == (3, 0)
    assert worker.backlog.depth()["interactive"] == (0, 0)


def test_the_default_broker_is_the_worker_redis_in_any_url_form(start_worker, redis_server_factory):
    url = redis_server_factory(unix_socket=True).url + "?db=3"
    handle = start_worker(url=url)
    app = celery.Celery("app", broker=celery_url(url), backend=celery_url(url))
    try:
        res = generate_signature(prompt="Hello", sampling=GREEDY, app=app).apply_async()
        assert res.get(timeout=30)["usage"]["completion_tokens"] == 4
    finally:
        app.close()
    db3 = redis.Redis.from_url(url)
    assert db3.exists(f"celery-task-meta-{res.id}") and db3.llen(CELERY_QUEUE) == 0
    db3.close()
    assert handle.stop() == 0


def test_a_full_engine_still_hears_revokes_and_the_ingress_does_not_spin(start_worker, make_engine, redis_server):
    one_at_a_time = make_engine(max_num_seqs=1)  # admission capacity 2: one running, one waiting
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    long = generate_signature(prompt="long", sampling={"temperature": 0, "max_tokens": 300, "ignore_eos": True},
                              app=app).apply_async()
    short = [generate_signature(prompt=f"short {i}", sampling=GREEDY, app=app).apply_async() for i in range(2)]
    handle = start_worker(SlowEngine(one_at_a_time))
    ingress, ticks = handle.worker.celery, [0]
    tick = ingress.tick

    def counted_tick():
        ticks[0] += 1
        tick()

    ingress.tick = counted_tick
    wait_for(lambda: long.state == "PROGRESS", what="the long task to run")
    started, ticks[0] = time.monotonic(), 0
    long.revoke()  # the engine is full: the ingress holds as many tasks as it may
    with pytest.raises(celery.exceptions.TaskRevokedError):
        long.get(timeout=20)
    assert ticks[0] / (time.monotonic() - started) < 100  # about 10 rounds a second, not a busy loop
    assert [t.get(timeout=20)["usage"]["completion_tokens"] for t in short] == [4, 4]
    app.close()


def test_without_the_celery_package_the_worker_warns_once_and_runs(start_worker, client, monkeypatch, caplog):
    caplog.set_level("WARNING", logger="worker")
    monkeypatch.setitem(sys.modules, "celery", None)  # import celery -> ImportError
    handle = start_worker()
    assert handle.worker.celery is None and handle.worker.backlog.celery is None
    job_id = client.submit("Hello", sampling=GREEDY)
    assert client.result(job_id, timeout=20).usage.completion_tokens == 4
    warnings = [r for r in caplog.records if r.getMessage() == "celery.unavailable"]
    assert len(warnings) == 1 and "--no-celery" in warnings[0].fields["hint"]
    assert handle.stop() == 0


def test_the_heartbeat_names_the_celery_queue_the_worker_consumes(idle_worker, redis_server):
    """What the backlog monitors of the fleet split a Celery queue's tasks by."""
    assert idle_worker(redis_server, celery_queue="tasks").heartbeat.base.celery_queue == "tasks"
    assert idle_worker(redis_server, celery=False).heartbeat.base.celery_queue is None


def test_no_celery_means_no_ingress_and_no_celery_backlog(idle_worker, redis_server):
    worker = idle_worker(redis_server, celery=False)
    send(redis_server, 2)
    worker.backlog.tick()
    assert worker.celery is None and "celery:sluiceway" not in worker.backlog.depth()


def test_tasks_that_are_no_job_fail_with_the_reason_and_the_rest_run(start_worker, redis_server):
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    other = app.send_task("someone.else", kwargs={"prompt": "x"}, queue=CELERY_QUEUE)
    bad = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"temperature": -1}}, queue=CELERY_QUEUE)
    good = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": GREEDY}, queue=CELERY_QUEUE)
    start_worker()
    with pytest.raises(Exception, match="serves only sluiceway.generate, not 'someone.else'"):
        other.get(timeout=20)
    with pytest.raises(Exception, match="temperature"):
        bad.get(timeout=20)
    assert good.get(timeout=20)["usage"]["completion_tokens"] == 4
    app.close()


def test_a_message_with_malformed_args_or_kwargs_fails_naming_them(start_worker, redis_server):
    """As a client in another language may send them (Celery's own refuses to): such a message
    stopped the ingress's round and stayed unacknowledged, its task PENDING for ever."""
    exchange = kombu.Exchange(CELERY_QUEUE, type="direct")
    with kombu.Connection(celery_url(redis_server)) as conn:
        producer = conn.Producer()
        for task_id, body in (("bad-kwargs", [[], "abc", {}]), ("bad-args", [5, {"prompt": "x"}, {}])):
            producer.publish(body, exchange=exchange, routing_key=CELERY_QUEUE, serializer="json",
                             headers={"id": task_id, "task": TASK_NAME},
                             declare=[kombu.Queue(CELERY_QUEUE, exchange, routing_key=CELERY_QUEUE)])
    start_worker()
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    with pytest.raises(Exception, match="kwargs: expected a mapping, got str"):
        app.AsyncResult("bad-kwargs").get(timeout=20)
    with pytest.raises(Exception, match="args: expected a list, got int"):
        app.AsyncResult("bad-args").get(timeout=20)
    good = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": GREEDY}, queue=CELERY_QUEUE)
    assert good.get(timeout=20)["usage"]["completion_tokens"] == 4
    app.close()


def test_a_task_sent_with_celery_message_protocol_1_runs(start_worker, redis_server):
    """``task_protocol = 1``, which Celery's worker still takes: the headers name no task, the body
    is one mapping. Such a task was acknowledged unstored (no id in the headers), PENDING for ever."""
    app = celery.Celery("app", broker=redis_server, backend=redis_server, task_protocol=1)
    ok = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": GREEDY}, queue=CELERY_QUEUE)
    bad = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"max_tokens": -3}}, queue=CELERY_QUEUE)
    pickled = app.send_task(TASK_NAME, kwargs={"prompt": "x"}, queue=CELERY_QUEUE, serializer="pickle")
    start_worker()
    assert ok.get(timeout=20)["usage"]["completion_tokens"] == 4
    with pytest.raises(Exception, match="max_tokens"):
        bad.get(timeout=20)
    with pytest.raises(Exception, match="not a JSON task message"):  # its id is in the unread pickle too
        pickled.get(timeout=20)
    app.close()


def test_a_chain_step_given_a_prompt_and_the_previous_result_fails_saying_so(start_worker, redis_server):
    """A chain step gets the previous result as its first argument: with ``prompt=`` too, the
    failure said "takes one positional argument (the prompt), got 1"."""
    start_worker()
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    chained = celery.chain(generate_signature(prompt="Hello", sampling=GREEDY, app=app),
                           generate_signature(prompt="again", sampling=GREEDY, app=app)).apply_async()
    with pytest.raises(Exception, match=r"prompt: given by name and as the positional argument .*\.si\(\)"):
        chained.get(timeout=20)
    app.close()
