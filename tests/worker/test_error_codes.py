"""Protocol 1.1's error codes, end to end: a job that reaches each one through a real worker,
the code in its hash and its dead letter, and the client's typed exception."""

from __future__ import annotations

import json
import time

import pytest
import redis

from producers.client import Client
from producers.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidJob,
    InvalidJobFailed,
    JobCancelled,
    JobError,
    JobExpired,
    JobFailed,
    MaxAttemptsExceeded,
    UnstorableOutput,
)
from producers.protocol import SUBMIT_SCRIPT, ErrorCode, Keys, submit_keys
from tests.worker.conftest import SlowEngine, pending_count, wait_for
from tests.worker.test_loop import PoisonedEngine

KEYS = Keys()
QUEUE = "interactive"
SHORT = {"temperature": 0, "max_tokens": 2}
LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


def submit_raw(r: redis.Redis, job_id: str, raw: str) -> None:
    """What a producer in another language does: the documented submit script, any text as the job."""
    r.eval(SUBMIT_SCRIPT, 5, *submit_keys(KEYS, job_id, QUEUE), raw, repr(time.time()), QUEUE, "0")


def dead_letter_codes(r: redis.Redis) -> dict[str, str]:
    return {fields["job_id"]: fields.get("error_code") for _, fields in r.xrange(KEYS.dead)}


def assert_ended_with(client: Client, r: redis.Redis, job_id: str, status: str, code: ErrorCode,
                      exception: type[JobError]) -> JobError:
    with pytest.raises(exception) as info:
        client.result(job_id, timeout=60)
    assert info.value.code == code.value and info.value.status == status, (job_id, info.value)
    assert type(info.value) is exception
    fields = r.hgetall(KEYS.job(job_id))
    assert fields["status"] == status and fields["error_code"] == code.value, (job_id, fields)
    assert fields["error"]  # the free text stays
    assert client.status(job_id).error_code is code
    return info.value


def test_every_way_a_job_can_end_badly_carries_its_code_and_raises_its_exception(start_worker, client, r, engine):
    cancel_queued = client.submit("Hello", sampling=SHORT)
    assert client.cancel(cancel_queued)  # no worker yet: the cancel script ends it
    # An entry written by hand, with no hash: the cancel only sets the key; START ends it.
    r.xadd(KEYS.queue(QUEUE), {"job": json.dumps({"v": 1, "id": "cancel-at-start", "prompt": "x"})})
    client.cancel("cancel-at-start")
    submit_raw(r, "invalid", json.dumps({"v": 1, "id": "invalid", "prompt": "x", "priority": "5"}))
    too_long_text = client.submit("Hello", sampling={"max_tokens": engine.max_model_len})  # the preparer's check
    too_long_ids = client.submit(prompt_token_ids=[7] * (engine.max_model_len + 1), sampling={"max_tokens": 1})
    bad_token = client.submit(prompt_token_ids=[engine.vocab_size + 5], sampling={"max_tokens": 1})
    expired_queued = client.submit("Hello", sampling=SHORT, deadline=time.time() - 5)
    exhausted = client.submit("Hello", sampling=SHORT)
    r.hset(KEYS.job(exhausted), "attempts", 3)  # three workers started it and died
    broken_keys = client.submit("Hello", sampling=SHORT)
    r.set(KEYS.done(broken_keys), "not a list")  # its start is refused for good (WRONGTYPE)
    poisoned = client.submit(prompt_token_ids=[13, 30, 31], sampling=SHORT)  # PoisonedEngine's fault
    cancel_running = client.submit("Hello", sampling=LONG)
    expire_running = client.submit("Hello", sampling=LONG, deadline=time.time() + 2)  # 400 steps take >= 4 s
    unstorable = client.submit("Hello", sampling=LONG, stream=True)
    good = client.submit("Hello", sampling=SHORT)

    start_worker(PoisonedEngine(SlowEngine(engine, step_s=0.01)), max_attempts=3)
    wait_for(lambda: r.hget(KEYS.job(cancel_running), "status") == "running", what="the job to cancel to run")
    client.cancel(cancel_running)
    wait_for(lambda: r.hget(KEYS.job(unstorable), "status") == "running", what="the unstorable job to run")
    r.delete(KEYS.done(unstorable))
    r.set(KEYS.done(unstorable), "not a list")  # its next write can never be stored as is

    assert client.result(good, timeout=90).usage.completion_tokens == 2  # behind three long jobs, on a loaded CI
    C = ErrorCode
    assert_ended_with(client, r, cancel_queued, "cancelled", C.CANCELLED, JobCancelled)
    assert_ended_with(client, r, "cancel-at-start", "cancelled", C.CANCELLED, JobCancelled)
    assert_ended_with(client, r, cancel_running, "cancelled", C.CANCELLED, JobCancelled)
    error = assert_ended_with(client, r, "invalid", "failed", C.INVALID_JOB, InvalidJobFailed)
    assert isinstance(error, InvalidJob) and isinstance(error, JobFailed)  # either except clause catches it
    for job_id in (too_long_text, too_long_ids):
        error = assert_ended_with(client, r, job_id, "failed", C.CONTEXT_LENGTH_EXCEEDED, ContextLengthExceeded)
        assert "max_model_len" in error.error and isinstance(error, InvalidJob)
    assert_ended_with(client, r, bad_token, "failed", C.INVALID_JOB, InvalidJobFailed)
    assert_ended_with(client, r, expired_queued, "expired", C.EXPIRED, JobExpired)
    assert "passed while running" in assert_ended_with(client, r, expire_running, "expired", C.EXPIRED, JobExpired).error
    assert_ended_with(client, r, exhausted, "failed", C.MAX_ATTEMPTS_EXCEEDED, MaxAttemptsExceeded)
    assert_ended_with(client, r, broken_keys, "failed", C.UNSTORABLE_OUTPUT, UnstorableOutput)
    assert_ended_with(client, r, unstorable, "failed", C.UNSTORABLE_OUTPUT, UnstorableOutput)
    error = assert_ended_with(client, r, poisoned, "failed", C.ENGINE_ERROR, EngineError)
    assert "kernel fault on token 13" in error.error
    assert r.hget(KEYS.job(good), "error_code") is None and client.status(good).error_code is None
    # The dead letters of the jobs that have one carry the same code.
    assert dead_letter_codes(r) == {"invalid": "invalid_job", exhausted: "max_attempts_exceeded",
                                    broken_keys: "unstorable_output"}
    wait_for(lambda: pending_count(r, QUEUE) == 0, what="the pending list to drain")


def test_a_celery_failure_carries_the_code(start_worker, redis_server):
    celery = pytest.importorskip("celery")
    from producers.celery_app import CELERY_QUEUE, TASK_NAME, TaskFailed

    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    try:
        bad = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"temperature": "hot"}}, queue=CELERY_QUEUE)
        long = app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"max_tokens": 10_000}}, queue=CELERY_QUEUE)
        start_worker()
        # NOTE: Celery rebuilds a failure from its text alone, so it is TaskFailed whatever the
        # code: the code is in the text and on .code.
        with pytest.raises(TaskFailed, match="sampling.temperature: expected a number") as info:
            bad.get(timeout=30)
        assert info.value.code == "invalid_job" and "[invalid_job]" in str(info.value)
        with pytest.raises(TaskFailed) as info:
            long.get(timeout=30)
        assert info.value.code == "context_length_exceeded"
    finally:
        app.close()
