"""Every worker script runs as the ``worker`` ACL user: each command a script runs is one its
role grants, on Redis 6.2 and 7 (a refused command inside a script fails the whole call)."""

from __future__ import annotations

import json

import pytest
import redis

from producers.acl import WORKER_NO_CELERY, setuser_args
from producers.protocol import CONSUMER_GROUP, Keys
from tests.redis_server import find_redis_server, redis7_executable, server_major
from worker.scripts import Scripts

KEYS = Keys()
QUEUE = "interactive"
ADMIN, PASSWORD = "admin-secret", "worker-secret"


@pytest.fixture(params=["6.2", "7"])
def worker_client(request, redis_server_factory):
    executable = find_redis_server() if request.param == "6.2" else redis7_executable()
    server = redis_server_factory(executable=executable, password=ADMIN)
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", *setuser_args(WORKER_NO_CELERY, KEYS.prefix, server_major(admin), PASSWORD))
    admin.close()
    client = redis.Redis(host=server.host, port=server.port, username=WORKER_NO_CELERY.name, password=PASSWORD,
                         decode_responses=True)
    client.xgroup_create(KEYS.queue(QUEUE), CONSUMER_GROUP, id="0", mkstream=True)
    yield client
    client.close()


def read_one(r, job_id: str) -> str:
    """Append a job entry the way a producer does (as the admin would) and read it as the worker."""
    r.xadd(KEYS.queue(QUEUE), {"job": json.dumps({"v": 1, "id": job_id, "prompt": "x"})})
    ((_, ((entry, _),)),) = r.xreadgroup(CONSUMER_GROUP, "w1", {KEYS.queue(QUEUE): ">"}, count=1)
    return entry


def test_every_worker_script_runs_as_the_worker_user(worker_client):
    r, scripts = worker_client, Scripts(worker_client, KEYS, "w1")
    run = dict(queue=QUEUE, now=2.0, ttl=60, stream=True)

    entry = read_one(r, "a")  # start, stream deltas, heartbeat, finish
    assert scripts.start(r, job_id="a", entry_id=entry, enqueued_at=1.0, max_attempts=3, raw="{}", **run)[0] == "start"
    assert scripts.write(r, job_id="a", entry_id=entry, attempt=1, deltas=[("0", "0", "hi", "[1]", "")], **run) == "written"
    assert scripts.heartbeat(r, queue=QUEUE, runs=[("a", entry, 1)]) == [1]
    assert scripts.write(r, job_id="a", entry_id=entry, attempt=1, end="finish", status="done", result="{}",
                         finish_reason="length", **run) == "ended"

    entry = read_one(r, "b")  # start, release, start again, fail unstorable output
    scripts.start(r, job_id="b", entry_id=entry, enqueued_at=1.0, max_attempts=3, raw="{}", **run)
    assert scripts.write(r, job_id="b", entry_id=entry, attempt=1, end="release", **run) == "released"
    scripts.start(r, job_id="b", entry_id=entry, enqueued_at=1.0, max_attempts=3, raw="{}", **run)
    assert scripts.write(r, job_id="b", entry_id=entry, attempt=1, end="fail", status="failed", error="no",
                         finish_reason="failed", **run) == "ended"

    entry = read_one(r, "c")  # an invalid job, failed and dead-lettered at read time
    assert scripts.finish(r, job_id="c", entry_id=entry, status="failed", error="bad", dead_raw="{}", **run) == 1
    entry = read_one(r, "d")  # an entry with no id
    assert scripts.dead(r, queue=QUEUE, entry_id=entry, raw="{}", error="no id", now=2.0) == 1
    assert r.hget(KEYS.job("a"), "status") == "done" and r.hget(KEYS.job("b"), "status") == "failed"
