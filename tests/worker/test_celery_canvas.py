"""Celery's canvas over GPU tasks: chords, chains, link and link_error, with a real Celery
worker running the callbacks on a queue of their own, routed by ``--celery-config``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from producers.celery_app import CELERY_QUEUE, TaskFailed, generate_signature
from tests.worker.conftest import wait_for

celery = pytest.importorskip("celery")

CONFIG = "tests.worker.celery_callbacks:config"
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture
def canvas(redis_server) -> Iterator:
    """The callbacks' app (tests/worker/celery_callbacks.py) on the test Redis, and a Celery worker running it."""
    os.environ["SLUICEWAY_TEST_CELERY_URL"] = redis_server
    sys.modules.pop("tests.worker.celery_callbacks", None)
    celery_callbacks = importlib.import_module("tests.worker.celery_callbacks")  # its app on this Redis

    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.worker.celery_callbacks:app", "worker", "--pool", "solo",
         "-Q", celery_callbacks.CALLBACK_QUEUE, "-n", "callbacks@test", "--without-heartbeat", "--without-mingle",
         "--without-gossip", "-l", "WARNING"],
        env={**os.environ, "SLUICEWAY_TEST_CELERY_URL": redis_server}, stdout=subprocess.DEVNULL)
    try:
        yield celery_callbacks
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        celery_callbacks.app.close()
        os.environ.pop("SLUICEWAY_TEST_CELERY_URL", None)


def generate(app, prompt: str, **fields):
    return generate_signature(prompt=prompt, sampling=GREEDY, app=app, **fields)


def too_long(app, engine):
    """A generation the engine fails: its prompt is past the model's context."""
    return generate_signature(prompt_token_ids=[1] * (engine.max_model_len + 8), sampling=GREEDY, app=app)


def test_a_chord_over_generations_runs_its_callback_on_the_callbacks_worker(canvas, start_worker, engine):
    start_worker(celery_config=CONFIG)
    app = canvas.app
    header = [generate(app, f"grade answer {i}") for i in range(3)]
    result = celery.chord(header)(canvas.aggregate.s())
    assert result.get(timeout=60) == {"n": 3, "tokens": 12}
    # Stored with the request's context: result_extended (from --celery-config) names the task.
    first = app.AsyncResult(result.parent.results[0].id)
    assert first.name == "sluiceway.generate" and first.queue == CELERY_QUEUE


def test_a_chain_and_link_continue_after_a_generation(canvas, start_worker):
    start_worker(celery_config=CONFIG)
    app = canvas.app
    chained = celery.chain(generate(app, "Hello"), canvas.postprocess.s(suffix="?")).apply_async()
    text = chained.get(timeout=60)
    assert text.endswith("?") and text == text.upper()
    linked = generate(app, "Hi").apply_async(link=canvas.postprocess.s())
    linked.get(timeout=30)
    [child] = linked.children  # stored with the result, as a Celery worker stores it
    assert child.get(timeout=30).endswith("!")


def test_a_failed_generation_fails_its_chord_and_fires_link_error(canvas, start_worker, engine):
    start_worker(celery_config=CONFIG)
    app = canvas.app
    header = [generate(app, "fine"), too_long(app, engine)]
    result = celery.chord(header)(canvas.aggregate.s())
    with pytest.raises(TaskFailed, match="max_model_len"):
        result.get(timeout=60)  # the failed part, raised first, as Celery does
    body = app.AsyncResult(result.id)
    wait_for(lambda: body.state == "FAILURE", what="the chord body to fail")
    assert isinstance(body.result, celery.exceptions.ChordError) and "max_model_len" in str(body.result)
    failing = too_long(app, engine).apply_async(link_error=canvas.on_error.s())
    with pytest.raises(TaskFailed, match="max_model_len"):
        failing.get(timeout=30)
    errors = redis.Redis.from_url(canvas.URL)
    assert errors.blpop("canvas:errors", timeout=30) == (b"canvas:errors", failing.id.encode())
    errors.close()
    chained = celery.chain(too_long(app, engine), canvas.postprocess.s()).apply_async()
    with pytest.raises(TaskFailed, match="max_model_len"):
        chained.get(timeout=30)
    wait_for(lambda: chained.state == "FAILURE", what="the failure to reach the chain's last step")


def test_a_task_of_an_unknown_name_in_a_chord_fails_the_chord(start_worker, redis_server):
    """Its failure was stored without its request context: its chord part was never counted and
    the body stayed PENDING for ever. The body is no task of any worker: a failed chord never runs it."""
    start_worker()
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    header = [generate_signature(prompt="fine", sampling=GREEDY, app=app),
              app.signature("someone.else", kwargs={"prompt": "x"}, queue=CELERY_QUEUE)]
    result = celery.chord(header)(app.signature("nobody.aggregate", queue="nobody"))
    with pytest.raises(Exception, match="serves only sluiceway.generate, not 'someone.else'"):
        result.get(timeout=20)  # the failed part, raised first
    body = app.AsyncResult(result.id)
    wait_for(lambda: body.state == "FAILURE", timeout=10, what="the chord body to fail")
    assert isinstance(body.result, celery.exceptions.ChordError) and "someone.else" in str(body.result)
    app.close()
