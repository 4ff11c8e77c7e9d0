"""One bad job never wedges a worker: unstorable output, a wedged writer, an entry that raises."""

from __future__ import annotations

import json

from producers.client import Client
from producers.protocol import CONSUMER_GROUP, Completion, JobResult, Keys, Status, TokenDelta, Usage, parse_job
from tests.worker.conftest import CLIENT_KWARGS, SlowEngine, pending_count, wait_for
from worker.admission import Held, Work
from worker.healthcheck import check
from worker.metrics import Metrics
from worker.results import ResultWriter
from worker.scripts import Scripts

KEYS = Keys()
QUEUE = KEYS.queue("interactive")


def started_works(r, client: Client, scripts: Scripts, sink, jobs: list[dict]) -> list[Work]:
    """Submit ``jobs``, read them as consumer ``w1`` and start each: runs a writer can end."""
    ids = [client.submit(**job) for job in jobs]
    r.xgroup_create(QUEUE, CONSUMER_GROUP, id="0", mkstream=True)
    ((_, entries),) = r.xreadgroup(CONSUMER_GROUP, "w1", {QUEUE: ">"}, count=len(ids))
    works = []
    for entry_id, fields in entries:
        job = parse_job(fields["job"])
        reply = scripts.start(r, job_id=job.id, queue="interactive", entry_id=entry_id, now=1.0, enqueued_at=1.0,
                              max_attempts=3, ttl=60, stream=job.stream, raw=fields["job"])
        assert reply[0] == "start"
        works.append(Work(job=job, sink=sink, queue="interactive", entry_id=entry_id, attempt=int(reply[1])))
    assert [w.id for w in works] == ids
    return works


def result_of(work: Work, text: str = "ok", metadata=None) -> JobResult:
    return JobResult(id=work.id, text=text, outputs=[Completion(text=text, token_ids=[1], finish_reason="stop")],
                     usage=Usage(prompt_tokens=1, completion_tokens=1), metadata=metadata or {})


def nested(depth: int) -> dict:
    """A JSON object ``depth`` levels deep: valid input, beyond what pydantic serializes."""
    root = node = {}
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


def test_an_output_that_cannot_be_stored_fails_that_job_and_the_rest_of_the_round_is_written(r, redis_server):
    metrics = Metrics()
    held = Held()
    scripts = Scripts(r, KEYS, "w1")
    writer = ResultWriter(r, KEYS, scripts, held, metrics, result_ttl=60)
    with Client(redis_server, **CLIENT_KWARGS) as client:
        works = started_works(r, client, scripts, writer, [
            dict(prompt="good 0"), dict(prompt="too deep"), dict(prompt="surrogate", stream=True),
            dict(prompt="good 3", stream=True), dict(prompt="done key of the wrong type"), dict(prompt="good 5"),
        ])
    for work in works:
        held.add(work)
    good0, deep, surrogate, good3, wrong_type, good5 = works
    r.set(KEYS.done(wrong_type.id), "not a list")
    # One round: everything is queued before the writer's thread starts.
    writer.finish(good0, Status.DONE, result_of(good0))
    writer.finish(deep, Status.DONE, result_of(deep, metadata=nested(300)))
    writer.publish(surrogate, [TokenDelta(text="fine ")])
    writer.publish(surrogate, [TokenDelta(text="\ud800")])  # text Redis cannot hold
    writer.publish(good3, [TokenDelta(text="ok", token_ids=[1], finish_reason="stop")])
    writer.finish(good3, Status.DONE, result_of(good3))
    writer.finish(wrong_type, Status.DONE, result_of(wrong_type))
    writer.finish(good5, Status.DONE, result_of(good5))
    writer.start()
    try:
        assert writer.flush(timeout=20), "the writer wedged"
    finally:
        writer.stop()
    status = {w.id: r.hgetall(KEYS.job(w.id)) for w in works}
    for work in (good0, good3, good5):
        assert status[work.id]["status"] == "done" and json.loads(status[work.id]["result"])["text"] == "ok"
        assert r.lrange(KEYS.done(work.id), 0, -1) == ["done"]
    assert status[deep.id]["status"] == "failed"
    assert "could not store" in status[deep.id]["error"] and "serialization depth" in status[deep.id]["error"]
    assert status[wrong_type.id]["status"] == "failed" and "WRONGTYPE" in status[wrong_type.id]["error"]
    assert r.lrange(KEYS.done(wrong_type.id), 0, -1) == ["failed"]  # the broken signal key was replaced
    # The surrogate's run is failed whole (its first delta was in the same write), its stream closed.
    assert status[surrogate.id]["status"] == "failed" and "surrogates not allowed" in status[surrogate.id]["error"]
    assert [e["finish_reason"] for _, e in r.xrange(KEYS.tokens(surrogate.id))] == ["failed"]
    assert [e["text"] for _, e in r.xrange(KEYS.tokens(good3.id))] == ["ok"]
    for work in works:
        assert r.llen(KEYS.done(work.id)) == 1
    assert pending_count(r, "interactive") == 0 and r.xlen(QUEUE) == 0 and len(held) == 0
    assert metrics.writes_unstorable._value.get() == 3
    assert {w.id for w in writer.fenced.take()} == {deep.id, surrogate.id, wrong_type.id}  # out of the engine


def test_the_health_check_fails_while_the_writer_stores_nothing_and_passes_otherwise(start_worker, client, r,
                                                                                     engine):
    handle = start_worker(SlowEngine(engine, step_s=0.01), metrics_port=0, metrics_host="127.0.0.1")
    port = wait_for(lambda: handle.worker.metrics.port, what="the metrics endpoint")
    sampling = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    first = [client.submit(f"first {i}", sampling=sampling) for i in range(2)]
    for job_id in first:
        client.result(job_id, timeout=30)
    assert check(port, max_age=1.5) is None  # results flow: healthy
    ids = [client.submit(f"job {i}", sampling=sampling) for i in range(4)]
    wait_for(lambda: all(r.hget(KEYS.job(j), "status") == "running" for j in ids), what="four running jobs")
    # Redis holds every write for 8 s: results pile up in the writer, the loop keeps turning.
    r.execute_command("CLIENT", "PAUSE", "8000", "WRITE")
    problem = wait_for(lambda: check(port, max_age=1.5), timeout=7, what="the check to fail")
    assert "result writer has stored nothing" in problem
    r.execute_command("CLIENT", "UNPAUSE")
    for job_id in ids:
        assert client.result(job_id, timeout=30).usage.completion_tokens == 40
    wait_for(lambda: check(port, max_age=1.5) is None, what="the check to pass again")


def test_an_entry_that_makes_the_parse_raise_anything_fails_alone_and_the_rest_of_its_batch_runs(start_worker, r):
    good = [{"v": 1, "id": f"good-{i}", "prompt": "Hello", "sampling": {"max_tokens": 3}} for i in range(3)]
    # Nested deeper than json.loads recurses: the parse raises something other than a protocol error.
    deep = '{"v": 1, "id": "deep-1", "prompt": "x", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r.hset(KEYS.job("deep-1"), mapping={"status": "queued", "attempts": 0, "queue": "interactive"})
    r.xadd(QUEUE, {"job": json.dumps(good[0])})
    r.xadd(QUEUE, {"job": deep})
    for job in good[1:]:
        r.xadd(QUEUE, {"job": json.dumps(job)})
    start_worker()  # one read takes all four entries
    for job in good:
        assert r.blmove(KEYS.done(job["id"]), KEYS.done(job["id"]), 20) == "done"
    assert r.blmove(KEYS.done("deep-1"), KEYS.done("deep-1"), 20) == "failed"
    fields = r.hgetall(KEYS.job("deep-1"))
    assert fields["status"] == "failed" and "invalid job" in fields["error"]
    ((_, dead),) = r.xrange(KEYS.dead)
    assert dead["job_id"] == "deep-1" and json.loads(dead["entry"])["job"] == deep
    wait_for(lambda: pending_count(r, "interactive") == 0, what="nothing pending")


def test_a_start_refused_for_good_fails_the_job_with_the_reason_and_dead_letters_it(start_worker, client, r):
    job_id = client.submit("Hello", sampling={"max_tokens": 3})
    r.set(KEYS.done(job_id), "someone wrote a string here")  # the start script refuses the job's keys
    good = client.submit("Hello", sampling={"max_tokens": 3, "ignore_eos": True})
    start_worker()
    assert client.result(good, timeout=20).usage.completion_tokens == 3
    assert r.blmove(KEYS.done(job_id), KEYS.done(job_id), 20) == "failed"  # the broken key was replaced
    fields = r.hgetall(KEYS.job(job_id))
    assert fields["status"] == "failed" and "WRONGTYPE" in fields["error"] and fields["attempts"] == "0"
    ((_, dead),) = r.xrange(KEYS.dead)
    assert dead["job_id"] == job_id and dead["error"] == fields["error"]
    wait_for(lambda: pending_count(r, "interactive") == 0, what="nothing pending")
