"""The faults that held up by hand, kept as regression tests on real processes.

Real ``redis-server``s, real ``python -m worker`` processes on the tiny model, real Celery and
kombu producers: kill -9 three times in a row, Redis restarted / killed / paused, connections
killed under the worker, a large backlog read with flat memory, 1,000 cancels at once, and a
pickled Celery task that would run code if it were unpickled.
"""

from __future__ import annotations

import signal
import time

import pytest

from producers.celery_app import CELERY_QUEUE, TASK_NAME
from producers.client import Client
from producers.jobs import cancel_call
from producers.protocol import CANCEL_SCRIPT
from tests.worker.conftest import wait_for
from tests.worker.held_up import (
    KEYS,
    OBSERVER,
    all_ended,
    assert_each_ended_once,
    assert_nothing_left,
    count,
    kill_other_clients,
    observer,
    rss_bytes,
    statuses,
    streamed_tokens,
)
from tests.worker.test_process import spawn  # noqa: F401  (the fixture)

GREEDY = {"temperature": 0, "ignore_eos": True}


# each a worker start (~4 s on CI, twice that beside the suite's other process): the repeated
# kills matter, not their number (test_resume.py kills the same jobs twice and checks each token)
KILLS = 3


def submit(client: Client, n: int, max_tokens: int, stream_every: int = 4, tag: str = "job") -> list[str]:
    return client.submit_many([{"prompt": f"{tag} {i}", "sampling": {**GREEDY, "max_tokens": max_tokens},
                                "stream": i % stream_every == 0} for i in range(n)])


def test_kill_9_three_times_with_restarts_loses_and_doubles_nothing(spawn, redis_server):
    r = observer(redis_server)
    client = Client(redis_server, socket_timeout=60)
    ids = submit(client, 64, max_tokens=32)
    held_at_kill: dict[str, int] = dict.fromkeys(ids, 0)
    for kill in range(KILLS):
        before = count(r, ids, "done")
        worker = spawn("--name", "crashy", "--max-attempts", "12", "--no-celery", redis_url=redis_server)
        wait_for(lambda: count(r, ids, "done") > before, timeout=60, what=f"progress before kill {kill + 1}")
        worker.stop(signal.SIGKILL)
        running = [j for j, s in zip(ids, statuses(r, ids)) if s == "running"]
        assert running, f"kill {kill + 1} should land while jobs run"
        held = r.xpending(KEYS.queue("interactive"), "workers")["pending"]
        assert held >= len(running), f"kill {kill + 1}: {len(running)} jobs running, {held} entries unacknowledged"
        for job_id in running:
            held_at_kill[job_id] += 1
    last = spawn("--name", "crashy", "--max-attempts", "12", "--no-celery", redis_url=redis_server)
    results = {j: client.result(j, timeout=30) for j in ids}
    assert_each_ended_once(r, ids)
    for i, job_id in enumerate(ids):
        out = results[job_id].outputs[0]
        assert results[job_id].usage.completion_tokens == 32 and len(out.token_ids) == 32
        attempts = int(r.hget(KEYS.job(job_id), "attempts"))
        # Each start after the first follows a kill that found the job held; one held at a kill ran again.
        assert 1 + (held_at_kill[job_id] > 0) <= attempts <= 1 + held_at_kill[job_id], (job_id, attempts)
        if i % 4 == 0:  # streamed: resumed from its own stream, no token repeated or missing
            assert streamed_tokens(r, job_id) == (out.token_ids, out.text)
    assert sum(held_at_kill.values()) >= KILLS
    assert_nothing_left(r)
    assert last.stop() == 0
    client.close()


def test_redis_restart_crash_and_pause_mid_run(spawn, redis_server_factory):
    server = redis_server_factory(appendonly=True, appendfsync="always")
    r = observer(server.url)
    client = Client(server.url, socket_timeout=60)
    worker = spawn("--name", "steady", redis_url=server.url)
    faults = {
        "restart": lambda: server.restart(),
        "kill -9 and restart": lambda: server.restart(crash=True),
        "CLIENT PAUSE 2 s": lambda: r.execute_command("CLIENT", "PAUSE", 2000, "ALL"),
    }
    for name, fault in faults.items():
        ids = submit(client, 8, max_tokens=60, tag=name)
        wait_for(lambda: count(r, ids, "done") >= 2, timeout=60, what=f"two jobs done before {name}")
        assert count(r, ids, "running"), f"{name} should land while jobs run"
        fault()
        for job_id in ids:
            assert client.result(job_id, timeout=60).usage.completion_tokens == 60, name
        assert_each_ended_once(r, ids)
        assert_nothing_left(r)
    assert worker.proc.poll() is None
    assert worker.stop() == 0
    client.close()


def test_connection_flaps_end_every_job_once_and_the_worker_runs_on(spawn, redis_server):
    r = observer(redis_server)
    client = Client(redis_server, socket_timeout=60, client_name=OBSERVER)
    ids = submit(client, 32, max_tokens=40)
    worker = spawn("--name", "flappy", redis_url=redis_server)
    wait_for(lambda: count(r, ids, "running"), timeout=60, what="jobs running")
    flaps = 0
    while not all_ended(r, ids):
        done = count(r, ids, "done")
        # the worker's connections (and kombu's) die under it; right after a flap they may not be back yet
        wait_for(lambda: kill_other_clients(r) >= 1, timeout=30, what=f"a connection to kill at flap {flaps + 1}")
        flaps += 1
        wait_for(lambda: all_ended(r, ids) or count(r, ids, "done") > done, timeout=60,
                 what=f"progress after flap {flaps}")
    assert flaps >= 5
    assert_each_ended_once(r, ids)
    assert_nothing_left(r)
    assert worker.proc.poll() is None and r.hexists(KEYS.workers, "flappy")
    later = client.submit("after the flaps", sampling={**GREEDY, "max_tokens": 4})
    assert client.result(later, timeout=30).usage.completion_tokens == 4
    assert worker.stop() == 0
    client.close()


BACKLOG = 10_000
PAD = "x" * 4000  # metadata each job carries: 40 MB of backlog a greedy reader would hold


def test_a_large_backlog_is_read_with_flat_memory(spawn, redis_server):
    r = observer(redis_server)
    client = Client(redis_server, socket_timeout=60)
    worker = spawn("--name", "deep", "--no-celery", redis_url=redis_server)
    warm = client.submit_many([{"prompt": "hi", "sampling": {"max_tokens": 1}, "metadata": {"pad": PAD}}
                               for _ in range(16)])
    wait_for(lambda: all_ended(r, warm), timeout=60, what="the warm-up jobs")
    baseline = rss_bytes(worker)  # warm: the engine has run full batches of such jobs
    used_before = r.info("memory")["used_memory"]
    ids = client.submit_many([{"prompt": "hi", "sampling": {"max_tokens": 1}, "metadata": {"row": i, "pad": PAD}}
                              for i in range(BACKLOG)])
    backlog_bytes = r.info("memory")["used_memory"] - used_before
    assert backlog_bytes > 30e6
    peak = [baseline]

    def drained_more() -> bool:
        peak[0] = max(peak[0], rss_bytes(worker))
        held = r.xpending(KEYS.queue("interactive"), "workers")["pending"]
        assert held <= 16, f"{held} entries held: the reader took more than the engine has room for"
        return all_ended(r, ids[:600])

    wait_for(drained_more, timeout=60, what="600 jobs of the backlog drained")
    growth = peak[0] - baseline
    print(f"backlog {backlog_bytes / 1e6:.1f} MB in Redis; worker RSS {baseline / 1e6:.1f} MB warm,"
          f" at most +{growth / 1e6:.1f} MB while the backlog waited")
    assert growth < backlog_bytes / 8, f"RSS grew {growth / 1e6:.1f} MB beside a {backlog_bytes / 1e6:.1f} MB backlog"
    assert r.xlen(KEYS.queue("interactive")) > 100  # drained only partly: a backlog still waits beside the 16 held
    assert_each_ended_once(r, warm + ids[:600])
    worker.stop(signal.SIGKILL)
    client.close()


def test_a_thousand_cancels_at_once(spawn, redis_server):
    r = observer(redis_server)
    client = Client(redis_server, socket_timeout=60)
    ids = submit(client, 1000, max_tokens=400, stream_every=10)
    worker = spawn("--name", "canceller", redis_url=redis_server)
    wait_for(lambda: count(r, ids[:16], "running") >= 4, timeout=60, what="four jobs running")
    running = [j for j, s in zip(ids[:16], statuses(r, ids[:16])) if s == "running"]
    script = client.redis.register_script(CANCEL_SCRIPT)
    started = time.monotonic()
    with client.redis.pipeline(transaction=False) as pipe:
        for job_id in ids:
            script(**cancel_call(KEYS, job_id, "interactive", 3600, 3600), client=pipe)
        pipe.execute()
    wait_for(lambda: all_ended(r, ids), timeout=30, what="every job ended")
    took = time.monotonic() - started
    ends = assert_each_ended_once(r, ids, {"cancelled", "done"})
    assert ends.count("cancelled") >= 990 and took < 10, (ends.count("cancelled"), took)
    assert all(r.hget(KEYS.job(j), "status") == "cancelled" for j in running)  # 400 tokens: not finished
    assert_nothing_left(r)
    later = client.submit("after the cancels", sampling={**GREEDY, "max_tokens": 4})
    assert client.result(later, timeout=30).usage.completion_tokens == 4
    assert worker.stop() == 0
    client.close()


class RunsCodeWhenUnpickled:
    """Unpickling this calls ``open(marker, "w")``: a file appears where none should."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_pickled_celery_task_is_refused_unopened(spawn, redis_server, tmp_path):
    celery = pytest.importorskip("celery")
    kombu = pytest.importorskip("kombu")
    markers = [tmp_path / "celery-pwned", tmp_path / "kombu-pwned"]
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    app.conf.update(accept_content=["json", "pickle"], result_accept_content=["json"])
    by_celery = app.send_task(TASK_NAME, kwargs={"prompt": RunsCodeWhenUnpickled(str(markers[0]))},
                              queue=CELERY_QUEUE, serializer="pickle")
    with kombu.Connection(redis_server) as conn:
        exchange = kombu.Exchange(CELERY_QUEUE, type="direct")
        conn.Producer().publish([[], {"prompt": RunsCodeWhenUnpickled(str(markers[1]))}, {}], serializer="pickle",
                                exchange=exchange, routing_key=CELERY_QUEUE,
                                declare=[kombu.Queue(CELERY_QUEUE, exchange, routing_key=CELERY_QUEUE)],
                                headers={"task": TASK_NAME, "id": "kombu-pickled", "lang": "py"})
    by_kombu = app.AsyncResult("kombu-pickled")
    worker = spawn("--name", "picky", redis_url=redis_server)
    for result in (by_celery, by_kombu):
        with pytest.raises(Exception) as refused:
            result.get(timeout=60)
        assert not any(m.exists() for m in markers), "a pickled task was unpickled: its payload ran"
        assert "not a JSON task message (application/x-python-serialize)" in str(refused.value)
        assert result.state == "FAILURE"
    fine = app.send_task(TASK_NAME, kwargs={"prompt": "fine", "sampling": {**GREEDY, "max_tokens": 4}},
                         queue=CELERY_QUEUE)
    assert fine.get(timeout=60)["usage"]["completion_tokens"] == 4
    r = observer(redis_server)
    # the end is stored first, then the message acknowledged (a worker killed between the two
    # leaves it to run again and find its end): the ack may land just after the result reads
    wait_for(lambda: r.hlen("unacked") == 0, timeout=10, what="every message acknowledged")
    assert r.llen(CELERY_QUEUE) == 0
    assert not any(m.exists() for m in markers)
    app.close()
    assert worker.stop() == 0
