"""A round's token deltas of many streamed runs go out in one fenced ``APPEND`` call (a call per
run was about one per streamed token), and each run in it is fenced as ``WRITE`` fences it."""

from __future__ import annotations

import redis

from bench.instant_engine import InstantEngine
from producers.client import Client
from producers.protocol import Keys, Status, TokenDelta
from tests.worker.conftest import CLIENT_KWARGS, RunningWorker, worker_settings
from tests.worker.test_writer_hardening import started_works
from worker.admission import Held
from worker.loop import Worker
from worker.metrics import Metrics
from worker.results import ResultWriter
from worker.scripts import Scripts

KEYS = Keys()


def calls(url: str, command: str = "evalsha") -> int:
    with redis.Redis.from_url(url) as r:
        return r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def test_a_step_of_many_streamed_runs_is_one_script_call_and_fenced_or_ended_runs_write_nothing(r, redis_server):
    metrics, held = Metrics(), Held()
    scripts = Scripts(r, KEYS, "w1")
    writer = ResultWriter(r, KEYS, scripts, held, metrics, result_ttl=60)
    with Client(redis_server, **CLIENT_KWARGS) as client:
        works = started_works(r, client, scripts, writer, [dict(prompt=f"job {i}", stream=True) for i in range(44)])
    for work in works:
        held.add(work)
    live, (fenced, fenced_too, ended, wrong) = works[:40], works[40:]
    for work in (fenced, fenced_too):  # its successor of the same name started it again: attempt 2
        assert scripts.start(r, job_id=work.id, queue="interactive", entry_id=work.entry_id, now=1.0,
                             enqueued_at=1.0, max_attempts=3, ttl=60, stream=True, raw="{}")[1] == "2"
    assert scripts.write(r, job_id=ended.id, queue="interactive", entry_id=ended.entry_id, attempt=1, now=1.0,
                         ttl=60, stream=True, end="finish", status="done", result="{}") == "ended"
    r.set(KEYS.tokens(wrong.id), "not a stream")
    r.config_resetstat()
    for work in works:  # one step's deltas, queued before the writer's thread starts: one round
        writer.publish(work, [TokenDelta(offset=0, text=f"<{work.id[:4]}>", token_ids=[7])])
    writer.start()
    try:
        assert writer.flush(timeout=20), "the writer wedged"
    finally:
        writer.stop()
    # one APPEND for the 44 runs, then the WRITE that fails the one whose key holds another type
    assert calls(redis_server) == 2
    for work in live:
        assert [(e["offset"], e["text"], e["token_ids"]) for _, e in r.xrange(KEYS.tokens(work.id))] == [
            ("0", f"<{work.id[:4]}>", "[7]")]
        assert 0 < r.ttl(KEYS.tokens(work.id)) <= 60 and r.hget(KEYS.job(work.id), "status") == "running"
    for work in (fenced, fenced_too, ended):
        assert r.xlen(KEYS.tokens(work.id)) == 0
    assert r.hget(KEYS.job(fenced.id), "attempts") == "2" and r.hget(KEYS.job(fenced.id), "status") == "running"
    assert r.lrange(KEYS.done(ended.id), 0, -1) == ["done"]
    failed = r.hgetall(KEYS.job(wrong.id))
    assert failed["status"] == Status.FAILED.value and "WRONGTYPE" in failed["error"]
    assert [e["finish_reason"] for _, e in r.xrange(KEYS.tokens(wrong.id))] == ["failed"]  # replaced, closed
    assert metrics.writes_fenced._value.get() == 2
    assert {w.id for w in writer.fenced.take()} == {fenced.id, fenced_too.id, ended.id, wrong.id}
    assert len(held) == len(live)


def test_an_append_refused_for_memory_writes_nothing_and_writes_everything_when_retried(r, client):
    from producers.protocol import CONSUMER_GROUP

    queue = KEYS.queue("interactive")
    ids = [client.submit(f"x{i}", stream=True) for i in range(3)]
    r.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
    ((_, entries),) = r.xreadgroup(CONSUMER_GROUP, "w1", {queue: ">"}, count=3)
    scripts = Scripts(r, KEYS, "w1")
    parts = []
    for job_id, (entry, _) in zip(ids, entries):
        scripts.start(r, job_id=job_id, queue="interactive", entry_id=entry, now=1.0, enqueued_at=1.0,
                      max_attempts=3, ttl=60, stream=True, raw="{}")
        parts.append(scripts.append_part(job_id=job_id, queue="interactive", entry_id=entry, attempt=1,
                                         deltas=[("0", "0", "a", "[1]", ""), ("0", "1", "b", "[2]", "length")]))
    r.config_set("maxmemory", 1)
    try:
        try:
            scripts.append(r, parts, ttl=60)
            raise AssertionError("an APPEND over maxmemory was not refused")
        except redis.ResponseError as exc:
            assert "OOM" in str(exc)
        assert all(r.xlen(KEYS.tokens(j)) == 0 for j in ids)
    finally:
        r.config_set("maxmemory", 0)
    assert scripts.append(r, parts, ttl=60) == ["written"] * 3
    for job_id in ids:
        entries = [e for _, e in r.xrange(KEYS.tokens(job_id))]
        assert [(e["offset"], e["text"], e.get("finish_reason")) for e in entries] == [("0", "a", None),
                                                                                       ("1", "b", "length")]


class CountingEngine(InstantEngine):
    """Counts its steps that had requests: a round's ``APPEND`` follows at most one of them."""

    steps = 0

    def step(self):
        self.steps += bool(self._waiting)
        return super().step()


def test_a_worker_streaming_many_jobs_a_token_a_step_sends_far_fewer_script_calls_than_tokens(redis_server, tmp_path):
    jobs, tokens = 24, 40
    settings = worker_settings(tmp_path, redis_server, name="appends")
    with Client(redis_server, **CLIENT_KWARGS) as client:
        ids = client.submit_many([{"prompt": "hi", "stream": True, "sampling": {"max_tokens": tokens}}] * jobs)
        with redis.Redis.from_url(redis_server) as r:
            r.config_resetstat()  # the submit script's calls
        engine = CountingEngine(max_num_seqs=jobs, tokens_per_step=1, step_s=0.005)
        handle = RunningWorker(Worker(settings, engine=engine))
        try:
            results = [client.result(job_id, timeout=60) for job_id in ids]
            streamed = [t for d in client.stream_deltas(ids[-1], timeout=30) for t in d.token_ids]
            assert handle.stop() == 0
        finally:
            if handle.thread.is_alive():
                handle.stop(immediately=True)
    assert streamed == results[-1].outputs[0].token_ids and len(streamed) == tokens
    assert all(res.usage.completion_tokens == tokens for res in results)
    with redis.Redis.from_url(redis_server) as r:
        entries = sum(r.xlen(KEYS.tokens(job_id)) for job_id in ids)
    # a call per run per round would be about one per entry; now: a start and an end per job,
    # an APPEND per round (at most one per step: 40, or more where admission spread the jobs over
    # several steps, as it does on a loaded machine), and the loop's other scripts (heartbeats, the
    # polls of its Celery queues ...): 13 calls in a one-second run, more where a loaded machine slows it
    assert entries > jobs * tokens / 4, f"{entries} entries: the rounds did not keep up with the steps"
    assert tokens <= engine.steps < entries / 4, f"{engine.steps} steps for {entries} entries"
    assert calls(redis_server) <= 2 * jobs + engine.steps + 25, \
        f"{calls(redis_server)} script calls, {engine.steps} steps, {entries} entries"
