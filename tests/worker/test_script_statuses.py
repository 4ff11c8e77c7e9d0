"""Every script treats a job as ended exactly when its status is in ``TERMINAL_STATUSES``:
the worker's start, finish, write and heartbeat, and the client's cancel."""

from __future__ import annotations

import pytest
import redis

from producers.protocol import CANCEL_SCRIPT, CONSUMER_GROUP, TERMINAL_STATUSES, Keys, Status, cancel_keys, entry_ref
from worker.scripts import Scripts

KEYS = Keys()
QUEUE = "interactive"


@pytest.fixture
def r(redis_server):
    client = redis.Redis.from_url(redis_server, decode_responses=True)
    client.xgroup_create(KEYS.queue(QUEUE), CONSUMER_GROUP, id="0", mkstream=True)
    yield client
    client.close()


def job_in(r, status: Status) -> tuple[str, str]:
    """A job whose hash says ``status`` and, when running, names the run (w1, attempt 1) of its entry."""
    entry = r.xadd(KEYS.queue(QUEUE), {"job": "{}"})
    r.xreadgroup(CONSUMER_GROUP, "w1", {KEYS.queue(QUEUE): ">"}, count=1)
    job_id = f"job-{status.value}-{entry}"
    r.hset(KEYS.job(job_id), mapping={"status": status.value, "worker": "w1", "attempts": "1",
                                      "entry": entry_ref(QUEUE, entry), "queue": QUEUE})
    return job_id, entry


@pytest.mark.parametrize("status", list(Status), ids=[s.value for s in Status])
def test_every_script_ends_exactly_the_terminal_statuses(r, status):
    ended = status in TERMINAL_STATUSES
    scripts = Scripts(r, KEYS, "w1")
    run = dict(queue=QUEUE, now=2.0, ttl=60, stream=False)

    job_id, entry = job_in(r, status)
    reply = scripts.start(r, job_id=job_id, entry_id=entry, enqueued_at=1.0, max_attempts=3, raw="{}", **run)
    assert (reply[0] == "ended") is ended, reply

    job_id, entry = job_in(r, status)
    assert (scripts.write(r, job_id=job_id, entry_id=entry, attempt=1, **run) == "ended_before") is ended

    job_id, entry = job_in(r, status)
    assert (scripts.heartbeat(r, queue=QUEUE, runs=[(job_id, entry, 1)]) == [0]) is ended

    job_id, entry = job_in(r, status)
    assert (scripts.finish(r, job_id=job_id, entry_id=entry, status=Status.FAILED.value, **run) == 0) is ended
    assert (r.hget(KEYS.job(job_id), "status") == status.value) is ended

    job_id, _ = job_in(r, status)
    assert r.register_script(CANCEL_SCRIPT)(keys=cancel_keys(KEYS, job_id, QUEUE), args=[60, 2.0, 60]) == status.value
    assert (r.exists(KEYS.cancel(job_id)) == 0) is ended  # a live job is asked to stop; an ended one is left
