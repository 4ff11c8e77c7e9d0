"""A worker frozen past the claim time (SIGSTOP) wakes into jobs another worker took: every
write of its stale runs is fenced, so the other worker's streams and ends stay its own."""

from __future__ import annotations

import json
import os
import re
import signal
import time

from producers.protocol import Keys, WorkerInfo
from tests.worker.conftest import pending_count, wait_for
from tests.worker.test_process import spawn  # noqa: F401  (the fixture)

KEYS = Keys()
SAMPLING = {"temperature": 0, "max_tokens": 120, "ignore_eos": True}


def field(r, job_id: str, name: str):
    return r.hget(KEYS.job(job_id), name)


def test_a_frozen_worker_that_wakes_writes_nothing_into_the_jobs_another_worker_took(spawn, redis_server,  # noqa: F811
                                                                                      client, r):
    ids = [client.submit(f"job {i}", sampling=SAMPLING, stream=True) for i in range(4)]
    frozen = spawn("--name", "frozen", "--claim-idle-seconds", "1", "--no-celery", redis_url=redis_server)
    wait_for(lambda: all(r.xlen(KEYS.tokens(j)) > 0 for j in ids), timeout=60, what="four jobs streaming")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    assert all(field(r, j, "worker") == "frozen" and field(r, j, "status") == "running" for j in ids)
    taker = spawn("--name", "taker", "--claim-idle-seconds", "1", "--no-celery", redis_url=redis_server)
    # The taker claims the idle entries, starts each job again and streams it from the start.
    wait_for(lambda: all(field(r, j, "worker") == "taker" and r.xlen(KEYS.tokens(j)) > 0 for j in ids),
             timeout=60, what="the taker to stream all four")
    os.kill(frozen.proc.pid, signal.SIGCONT)  # it wakes mid-stream with four runs in its engine
    woke_at = time.time()
    results = {j: client.result(j, timeout=60) for j in ids}

    def frozen_settled():
        raw = r.hget(KEYS.workers, "frozen")
        info = WorkerInfo.model_validate_json(raw) if raw else None
        return info is not None and info.last_seen > woke_at + 1 and info.in_flight == 0

    wait_for(frozen_settled, timeout=30, what="the woken worker to let its stale runs go")
    ended_by = {}
    for job_id, result in results.items():
        entries = [e for _, e in r.xrange(KEYS.tokens(job_id))]
        assert "".join(e["text"] for e in entries) == result.text
        assert sum((json.loads(e["token_ids"]) for e in entries), []) == result.outputs[0].token_ids
        assert [e.get("finish_reason") for e in entries].count("length") == 1 and "finish_reason" in entries[-1]
        assert result.usage.completion_tokens == 120
        # NOTE: the taker refreshes its claims every 0.25 s (a quarter of --claim-idle-seconds 1); one
        # that stalls past 1 s on a loaded machine is silent by that measure and loses the job as the
        # frozen worker did: it is claimed again (by either worker: attempt 3) and runs on from its
        # stream, the taker's run fenced in turn. That is the product working; the stale runs still
        # wrote nothing, as the stream checked above and the frozen worker's log below show.
        ended_by[job_id] = field(r, job_id, "worker"), field(r, job_id, "attempts")
        assert ended_by[job_id] in {("taker", "2"), ("taker", "3"), ("frozen", "3")}, ended_by
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
    assert pending_count(r, "interactive") == 0 and r.xlen(KEYS.queue("interactive")) == 0
    assert frozen.stop() == 0 and taker.stop() == 0
    log = frozen.output()
    assert "write.fenced" in log and "job.dropped" in log  # its runs were refused and left its engine
    assert "job.released" not in log
    # it ended none of the runs it woke with: only those it started again, if any
    ended = re.findall(r"event=job\.ended job=(\S+) .*?\battempt=(\d+)", log)
    assert sorted(ended) == sorted((j, "3") for j, by in ended_by.items() if by[0] == "frozen"), ended


def test_a_run_superseded_under_the_same_worker_name_is_fenced_too(r, client):
    """A process restarted under the same --name re-reads its own pending entries and starts them
    again; the frozen process of that name must not write into those runs either."""
    from producers.protocol import CONSUMER_GROUP
    from worker.scripts import Scripts

    job_id = client.submit("x", stream=True)
    queue = KEYS.queue("interactive")
    r.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
    ((_, ((entry, fields),)),) = r.xreadgroup(CONSUMER_GROUP, "w1", {queue: ">"}, count=1)
    scripts = Scripts(r, KEYS, "w1")
    start = dict(job_id=job_id, queue="interactive", entry_id=entry, now=1.0, enqueued_at=1.0, max_attempts=3,
                 ttl=60, stream=True, raw=fields["job"])
    assert scripts.start(r, **start)[1] == "1"  # the process that froze
    assert scripts.start(r, **start)[1] == "2"  # its successor of the same name
    run = dict(job_id=job_id, queue="interactive", entry_id=entry, now=2.0, ttl=60, stream=True)
    stale_delta = [("0", "0", "stale", "[1]", "")]
    assert scripts.write(r, **run, attempt=1, deltas=stale_delta) == "fenced"
    assert scripts.write(r, **run, attempt=1, end="finish", status="done", result="{}") == "fenced"
    assert scripts.write(r, **run, attempt=1, end="release") == "fenced"
    assert scripts.heartbeat(r, queue="interactive", runs=[(job_id, entry, 1), (job_id, entry, 2)]) == [-1, 1]
    assert r.xlen(KEYS.tokens(job_id)) == 0 and field(r, job_id, "status") == "running"
    assert field(r, job_id, "attempts") == "2" and pending_count(r, "interactive") == 1
    assert scripts.write(r, **run, attempt=2, deltas=[("0", "0", "live", "[2]", "length")], end="finish",
                         status="done", result="{}") == "ended"
    assert [e["text"] for _, e in r.xrange(KEYS.tokens(job_id))] == ["live"]
    assert r.lrange(KEYS.done(job_id), 0, -1) == ["done"] and pending_count(r, "interactive") == 0


def test_a_stale_run_cannot_checkpoint_over_the_new_owner_nor_append_to_its_stream(r, client):
    """Script level: START keeps the tokens stream and hands the checkpoint to the new run;
    every write of the superseded run -- a checkpoint, a delta, a release -- is fenced."""
    from producers.protocol import CONSUMER_GROUP
    from worker.scripts import Scripts

    job_id = client.submit("x", stream=True)
    queue = KEYS.queue("interactive")
    r.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
    ((_, ((entry, fields),)),) = r.xreadgroup(CONSUMER_GROUP, "w1", {queue: ">"}, count=1)
    old, new = Scripts(r, KEYS, "w1"), Scripts(r, KEYS, "w2")
    start = dict(job_id=job_id, queue="interactive", entry_id=entry, now=1.0, enqueued_at=1.0, max_attempts=3,
                 ttl=60, stream=True, raw=fields["job"])
    run = dict(job_id=job_id, queue="interactive", entry_id=entry, now=2.0, ttl=60, stream=True)
    assert old.start(r, **start)[3:] == ["", "0"]  # no checkpoint, no stream yet
    assert old.write(r, **run, attempt=1, deltas=[("0", "0", "ab", "[1,2]", "")],
                     progress='{"token_ids":[1,2]}') == "written"
    r.xclaim(queue, CONSUMER_GROUP, "w2", 0, [entry])  # the entry goes to another worker, as XAUTOCLAIM does
    reply = new.start(r, **start)
    assert reply[1] == "2" and reply[3] == '{"token_ids":[1,2]}' and reply[4] == "1"  # it resumes from here
    assert [e["offset"] for _, e in r.xrange(KEYS.tokens(job_id))] == ["0"]  # the stream was kept
    assert new.write(r, **run, attempt=2, deltas=[("0", "2", "c", "[3]", "")],
                     progress='{"token_ids":[1,2,3]}') == "written"
    # the frozen first run wakes: its checkpoint, deltas and release change nothing
    assert old.write(r, **run, attempt=1, progress='{"token_ids":[1,2,9,9]}') == "fenced"
    assert old.write(r, **run, attempt=1, deltas=[("0", "2", "zz", "[9,9]", "")]) == "fenced"
    assert old.write(r, **run, attempt=1, end="release", progress='{"token_ids":[9]}') == "fenced"
    assert field(r, job_id, "progress") == '{"token_ids":[1,2,3]}'
    assert [(e["offset"], e["token_ids"]) for _, e in r.xrange(KEYS.tokens(job_id))] == [("0", "[1,2]"), ("2", "[3]")]
    assert new.write(r, **run, attempt=2, deltas=[("0", "3", "d", "[4]", "length")], end="finish",
                     status="done", result="{}") == "ended"
    assert field(r, job_id, "progress") is None and r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
