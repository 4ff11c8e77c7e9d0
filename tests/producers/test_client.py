"""The sync client against a real redis-server, with the worker's half played by ``Peer``."""

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest
import redis

from engine.sampling_params import SamplingParams
from producers.client import Client
from producers.errors import InvalidJob, JobCancelled, JobExpired, JobFailed, JobNotFound, Timeout
from producers.protocol import Keys, Status, TokenDelta, parse_job
from tests.producers.peer import Peer, result_for

K = Keys("sluiceway")


def entries(client, queue="interactive"):
    return [parse_job(fields["job"]) for _, fields in client.redis.xrange(K.queue(queue))]


def test_submit_writes_entry_and_hash_per_protocol(client):
    before = time.time()
    job_id = client.submit(
        "What is the capital of France?",
        sampling={"temperature": 0.7, "max_tokens": 256},
        priority=3,
        metadata={"row": 17},
    )
    assert re.fullmatch("[0-9a-f]{32}", job_id)  # 128 bits, as hex
    (job,) = entries(client)
    assert job.id == job_id and job.prompt.startswith("What")
    assert job.sampling["temperature"] == 0.7 and job.sampling["max_tokens"] == 256
    assert job.priority == 3 and job.metadata == {"row": 17} and job.stream is False
    raw = json.loads(client.redis.xrange(K.queue("interactive"))[0][1]["job"])
    assert raw["v"] == 1
    fields = client.redis.hgetall(K.job(job_id))
    assert fields["status"] == "queued" and fields["attempts"] == "0" and fields["queue"] == "interactive"
    assert before <= float(fields["enqueued_at"]) <= time.time()
    assert client.redis.ttl(K.job(job_id)) == -1  # lives until the job ends
    status = client.status(job_id)
    assert status.status is Status.QUEUED and not status.terminal and status.attempts == 0
    other = client.submit("What is the capital of France?", priority=3, metadata={"row": 17})
    # NOTE: two random 128-bit ids differ in 64 bits on average, in fewer than 16 with odds of
    # about 4e-20; ids from a counter, a clock or a hash of the job differ in a few bits or none.
    assert bin(int(job_id, 16) ^ int(other, 16)).count("1") >= 16


def test_submit_variants(client):
    a = client.submit(messages=[{"role": "user", "content": "hi"}], queue="bulk", stream=True)
    b = client.submit(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4, temperature=0.0))
    (ja,) = entries(client, "bulk")
    (jb,) = entries(client)
    assert ja.id == a and ja.messages[0].content == "hi" and ja.stream
    assert jb.id == b and jb.prompt_token_ids == [1, 2, 3] and jb.sampling["max_tokens"] == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "exactly one of prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "got prompt, prompt_token_ids"),
        ({"prompt": "a", "sampling": {"temperature": -1}}, "temperature must be >= 0"),
        ({"prompt": "a", "sampling": {"max_tokns": 3}}, "sampling.max_tokns: not a sampling field"),
        ({"prompt": "a", "job_id": "has space"}, "id 'has space'"),
        ({"prompt": "a", "queue": "no queue"}, "queue name"),
        ({"prompt": "a", "deadline": "soon"}, "deadline must be"),
    ],
)
def test_invalid_jobs_name_the_field(client, kwargs, field):
    with pytest.raises(InvalidJob) as info:
        client.submit(**kwargs)
    assert field in str(info.value)
    assert client.redis.dbsize() == 0


def test_deadlines(client):
    now = time.time()
    ids = [
        client.submit("a", deadline=30),
        client.submit("a", deadline=timedelta(minutes=1)),
        client.submit("a", deadline=now + 3600),
        client.submit("a", deadline=datetime.fromtimestamp(now + 7200, tz=timezone.utc)),
    ]
    got = {job.id: job.deadline for job in entries(client)}
    assert now + 29 < got[ids[0]] < now + 40
    assert now + 59 < got[ids[1]] < now + 70
    assert got[ids[2]] == pytest.approx(now + 3600)
    assert got[ids[3]] == pytest.approx(now + 7200)


def test_a_known_id_is_not_enqueued_again(client, peer):
    assert client.submit("a", job_id="row-1") == "row-1"
    assert client.submit("a", job_id="row-1") == "row-1"  # still queued: no second entry
    assert len(entries(client)) == 1
    peer.start("row-1")
    peer.finish("row-1")
    client.submit("a", job_id="row-1")  # ended: not run again
    assert len(entries(client)) == 1
    assert client.result("row-1", timeout=1).text == "Paris."


def test_a_fresh_id_clears_stale_signals(client):
    r = client.redis
    r.rpush(K.done("old"), "done")
    r.xadd(K.tokens("old"), {"text": "stale"})
    r.set(K.cancel("old"), "1")
    client.submit("a", job_id="old")
    assert not r.exists(K.done("old"), K.tokens("old"), K.cancel("old"))


def test_submit_many_is_correct_and_fast(client):
    n = 20_000
    jobs = [{"prompt": f"question {i}", "sampling": {"max_tokens": 8}, "metadata": {"row": i}} for i in range(n)]
    jobs[5] = {**jobs[5], "queue": "bulk", "id": "fixed-5"}
    start = time.perf_counter()
    ids = client.submit_many(jobs)
    elapsed = time.perf_counter() - start
    print(f"\nsubmit_many: {n} jobs in {elapsed:.2f}s = {n / elapsed:,.0f} jobs/s")
    assert len(ids) == len(set(ids)) == n and ids[5] == "fixed-5"
    r = client.redis
    assert r.xlen(K.queue("interactive")) == n - 1 and r.xlen(K.queue("bulk")) == 1
    first = entries(client)[:3]
    assert [j.metadata["row"] for j in first] == [0, 1, 2]  # stream order is submission order
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(K.job(job_id), "status")
        assert set(pipe.execute()) == {"queued"}
    again = [{**jobs[i], "id": ids[i]} for i in range(0, 100, 10)]
    assert client.submit_many(again) == ids[:100:10]  # known ids: nothing new
    assert r.xlen(K.queue("interactive")) == n - 1


def test_submit_many_rejects_a_bad_item_by_position(client):
    with pytest.raises(InvalidJob, match=r"job 1: sampling.top_p: top_p must be in \(0, 1\]"):
        client.submit_many([{"prompt": "ok"}, {"prompt": "bad", "sampling": {"top_p": 0}}])
    with pytest.raises(InvalidJob, match="unknown job field"):
        client.submit_many([{"prompt": "ok", "temperature": 1}])


def test_status_and_unknown_jobs(client, peer):
    with pytest.raises(JobNotFound, match="never submitted"):
        client.status("nope")
    with pytest.raises(JobNotFound):
        client.result("nope", timeout=0.1)
    job_id = client.submit("a")
    peer.start(job_id, worker="gpu-7")
    status = client.status(job_id)
    assert status.status is Status.RUNNING and status.worker == "gpu-7" and status.attempts == 1
    assert status.started_at >= status.enqueued_at


def test_result_blocks_until_the_done_signal(client, peer):
    job_id = client.submit("a", metadata={"row": 1})
    finisher = threading.Thread(target=lambda: (peer.wait_blocked(1), peer.finish(job_id, result=result_for(job_id, "Lyon."))))
    finisher.start()
    result = client.result(job_id, timeout=10)
    finisher.join()
    assert result.text == "Lyon." and result.usage.completion_tokens == 3


def test_many_waiters_and_repeated_calls_all_return(redis_server, peer):
    clients = [Client(redis_server) for _ in range(4)]
    job_id = clients[0].submit("a")
    results = [None] * 4

    def wait(i):
        results[i] = clients[i].result(job_id, timeout=10).text

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    peer.wait_blocked(4)
    peer.finish(job_id)
    for t in threads:
        t.join(10)
    assert results == ["Paris."] * 4
    assert clients[1].result(job_id).text == "Paris."  # and again
    assert peer.redis.llen(K.done(job_id)) == 1  # the signal is still there
    for c in clients:
        c.close()


@pytest.mark.parametrize(
    "status, error_class",
    [(Status.FAILED, JobFailed), (Status.CANCELLED, JobCancelled), (Status.EXPIRED, JobExpired)],
)
def test_result_raises_how_the_job_ended(client, peer, status, error_class):
    job_id = client.submit("a")
    peer.finish(job_id, status, error="prompt is 9000 tokens; max_model_len is 4096")
    with pytest.raises(error_class) as info:
        client.result(job_id, timeout=1)
    assert info.value.job_id == job_id and info.value.status == status.value
    assert "max_model_len" in str(info.value)


def test_result_timeout(client):
    job_id = client.submit("a")
    start = time.monotonic()
    with pytest.raises(Timeout) as info:
        client.result(job_id, timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 5
    assert isinstance(info.value, TimeoutError) and info.value.job_id == job_id


def test_stream_yields_deltas_until_finish_reason(client, peer):
    job_id = client.submit("a", stream=True)
    peer.token(job_id, "Par")

    def rest():
        peer.wait_blocked(1)
        peer.token(job_id, "is")
        peer.token(job_id, ".", finish_reason="stop")
        peer.finish(job_id)

    t = threading.Thread(target=rest)
    t.start()
    assert list(client.stream(job_id, timeout=10)) == ["Par", "is", "."]
    t.join()


def test_stream_of_a_job_without_stream_yields_the_whole_text(client, peer):
    job_id = client.submit("a")
    peer.finish(job_id)
    assert list(client.stream(job_id, timeout=5)) == ["Paris."]


def test_stream_of_a_job_without_stream_waits_on_the_done_signal(client, peer):
    """No deltas will come, so the client blocks on the done list (woken by the end itself),
    not on the tokens stream with its idle re-checks."""
    job_id = client.submit("a")
    got = []
    reader = threading.Thread(target=lambda: got.extend(client.stream(job_id, timeout=10)))
    reader.start()
    peer.wait_blocked(1)
    waiting = [c["cmd"] for c in peer.redis.client_list() if c["cmd"] in ("blmove", "xread", "blpop")]
    assert waiting == ["blmove"]
    peer.finish(job_id)
    reader.join(5)
    assert got == ["Paris."]


def test_stream_raises_when_the_job_is_cancelled(client, peer):
    job_id = client.submit("a", stream=True)
    peer.token(job_id, "Pa")
    peer.token(job_id, "", finish_reason="cancelled")
    peer.finish(job_id, Status.CANCELLED, error="cancelled by a client")
    got = []
    with pytest.raises(JobCancelled):
        for text in client.stream(job_id, timeout=5):
            got.append(text)
    assert got == ["Pa"]


def test_stream_timeout(client):
    job_id = client.submit("a", stream=True)
    with pytest.raises(Timeout):
        list(client.stream(job_id, timeout=0.2))


def test_cancel_of_a_running_job_sets_the_key_with_a_ttl(client, peer):
    job_id = client.submit("a")
    peer.start(job_id)
    assert client.cancel(job_id) is True
    assert client.redis.get(K.cancel(job_id)) == "1"
    assert 0 < client.redis.ttl(K.cancel(job_id)) <= 24 * 3600
    assert client.status(job_id).status is Status.RUNNING  # its worker ends it
    peer.finish(job_id, Status.CANCELLED)
    assert client.cancel(job_id) is False
    # no hash (a Celery task not yet read): unknown to the client, the key still set for its worker
    assert client.cancel("celery-task-id") is False
    assert client.redis.get(K.cancel("celery-task-id")) == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_cancel_ends_a_queued_job_at_once(client, stream):
    """No worker has started it: the cancel ends it the way a worker would, exactly once."""
    job_id = client.submit("a", stream=stream)
    assert client.cancel(job_id, result_ttl=600) is True
    with pytest.raises(JobCancelled, match="cancelled before it started"):
        client.result(job_id, timeout=1)
    r = client.redis
    assert r.lrange(K.done(job_id), 0, -1) == ["cancelled"]
    assert not r.exists(K.cancel(job_id))
    assert 0 < r.ttl(K.job(job_id)) <= 600 and 0 < r.ttl(K.done(job_id)) <= 600
    if stream:
        (_, last), = r.xrange(K.tokens(job_id))
        assert TokenDelta.from_fields(last).finish_reason == "cancelled"
    else:
        assert not r.exists(K.tokens(job_id))
    assert client.cancel(job_id) is False  # ended: nothing more happens
    assert r.lrange(K.done(job_id), 0, -1) == ["cancelled"]
    assert r.xlen(K.queue("interactive")) == 0  # its entry left the backlog with it


def test_cancel_leaves_a_job_of_an_older_producer_to_its_worker(client):
    """A hash without the stream field (submitted before the field existed): the worker ends it."""
    job_id = client.submit("a")
    client.redis.hdel(K.job(job_id), "stream")
    assert client.cancel(job_id) is True
    assert client.status(job_id).status is Status.QUEUED
    assert client.redis.get(K.cancel(job_id)) == "1"


def test_passwords_and_acl_users(redis_server_factory):
    server = redis_server_factory(password="s3cret")
    admin = server.client()
    grant = "~sluiceway:* +@read +@write +@scripting +@connection".split()  # as PROTOCOL.md says
    admin.execute_command("ACL", "SETUSER", "app", "on", ">apppw", *grant)
    host_port = f"{server.host}:{server.port}"
    with Client(f"redis://:s3cret@{host_port}/0") as c:
        assert c.status(c.submit("a")).status is Status.QUEUED
    peer = Peer(f"redis://:s3cret@{host_port}/0")
    with Client(f"redis://app:apppw@{host_port}/0") as c:
        job_id = c.submit_many([{"prompt": "a", "stream": True}])[0]
        assert c.status(job_id).status is Status.QUEUED
        peer.token(job_id, "Paris.", finish_reason="stop")  # (a stream ends at its closing entry: token first)
        assert c.cancel(job_id)
        peer.finish(job_id)
        assert c.result(job_id, timeout=1).text == "Paris." and list(c.stream(job_id)) == ["Paris."]
    peer.close()
    with Client(f"redis://app:wrong@{host_port}/0", retry=None) as c:
        with pytest.raises(redis.AuthenticationError):
            c.submit("a")
    admin.close()


def test_errors_rebuild_from_their_args():
    import pickle

    for error in (JobFailed("j", "failed", "boom"), JobNotFound("j", "p"), Timeout("j", 1.5)):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert type(error)(*error.args).args == error.args


def test_result_survives_a_redis_restart(redis_server_factory):
    server = redis_server_factory(appendonly=True, appendfsync="always")
    client = Client(server.url)
    job_id = client.submit("a")
    got = []
    waiter = threading.Thread(target=lambda: got.append(client.result(job_id, timeout=30).text))
    waiter.start()
    peer = Peer(server.url)
    peer.wait_blocked(1)
    server.restart(crash=True)
    peer.finish(job_id)
    waiter.join(30)
    assert got == ["Paris."]
    assert client.status(job_id).status is Status.DONE
    peer.close()
    client.close()


def test_result_timeout_longer_than_the_socket_read_timeout(client):
    """A wait past redis-py's default 5 s read timeout still ends as our Timeout, on time."""
    job_id = client.submit("never finished")
    started = time.monotonic()
    with pytest.raises(Timeout):
        client.result(job_id, timeout=6)
    assert 5.9 <= time.monotonic() - started < 8


def test_results_answer_in_order_see_a_later_job_fail_while_an_earlier_runs_ride_an_outage_and_time_out(
        redis_server_factory):
    """``results``: one blocked wait for several jobs, their answers in order whatever order they end
    in; a later job that fails while the first still runs raises within ``RESULTS_WATCH_S`` (a wait
    on each in turn would sit on the first); Redis restarting mid-wait is ridden; ``Timeout`` names
    the job waited on when the time is up."""
    from producers.jobs import RESULTS_WATCH_S

    server = redis_server_factory(appendonly=True, appendfsync="always")
    peer = Peer(server.url)
    with Client(server.url) as client, ThreadPoolExecutor(1) as pool:
        ids = client.submit_many([{"prompt": f"q{i}"} for i in range(3)])
        waiting = pool.submit(client.results, ids, timeout=30)
        peer.wait_blocked(1)
        for job_id in reversed(ids):
            peer.finish(job_id, result=result_for(job_id, job_id))
        assert [r.text for r in waiting.result(timeout=10)] == ids

        ids = client.submit_many([{"prompt": f"f{i}"} for i in range(3)])
        peer.start(ids[0])
        waiting = pool.submit(client.results, ids, timeout=5)
        peer.wait_blocked(1)
        started = time.monotonic()
        peer.finish(ids[2], Status.FAILED, error="model error: boom")  # the wait is on ids[0]
        with pytest.raises(JobFailed, match="boom") as info:
            waiting.result(timeout=RESULTS_WATCH_S + 1)
        assert info.value.job_id == ids[2] and time.monotonic() - started < RESULTS_WATCH_S + 0.5
        assert client.status(ids[0]).status is Status.RUNNING and peer.blocked_clients() == 0

        ids = client.submit_many([{"prompt": f"o{i}"} for i in range(2)])
        waiting = pool.submit(client.results, ids, timeout=30)
        peer.wait_blocked(1)
        peer.close()
        server.stop()
        server.start()  # the wait meets the refused connections meanwhile
        peer = Peer(server.url)
        for job_id in ids:
            peer.finish(job_id, result=result_for(job_id, job_id))
        assert [r.text for r in waiting.result(timeout=10)] == ids

        ids = client.submit_many([{"prompt": f"t{i}"} for i in range(2)])
        peer.finish(ids[0])
        started = time.monotonic()
        with pytest.raises(Timeout) as info:
            client.results(ids, timeout=0.3)
        assert info.value.job_id == ids[1] and 0.25 <= time.monotonic() - started < 2
    peer.close()


def test_stream_reads_by_offset_every_token_once(redis_server):
    """Entries a worker wrote twice (a lost reply) and the deltas of a run that resumed the job
    are read once each, in order; the stream ends at the completion's finish_reason."""
    keys = Keys()
    with Client(redis_server) as client:
        job_id = client.submit("x", stream=True)
        tokens = keys.tokens(job_id)
        written = [TokenDelta(offset=0, text="a", token_ids=[1]), TokenDelta(offset=1, text="b", token_ids=[2]),
                   TokenDelta(offset=1, text="b", token_ids=[2]),  # repeated after a lost reply
                   TokenDelta(offset=2, text="cd", token_ids=[3, 4]),  # a resumed run continues here
                   TokenDelta(offset=0, text="a", token_ids=[1]),  # a stray repeat from before
                   TokenDelta(offset=4, text="e", token_ids=[5], finish_reason="length"),
                   TokenDelta(offset=5, text="", token_ids=[], finish_reason="length")]  # a second end
        for delta in written:
            client.redis.xadd(tokens, delta.to_fields())
        client.redis.hset(keys.job(job_id), mapping={"status": "done", "result": json.dumps(
            {"id": job_id, "text": "abcde", "outputs": [{"text": "abcde", "token_ids": [1, 2, 3, 4, 5],
                                                         "finish_reason": "length"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 5}})})
        client.redis.rpush(keys.done(job_id), "done")
        read = list(client.stream_deltas(job_id, timeout=5))
        assert [d.token_ids for d in read] == [[1], [2], [3, 4], [5]]
        assert "".join(client.stream(job_id, timeout=5)) == "abcde"


def finished_stream(redis_client: redis.Redis, job_id: str) -> None:
    """What a worker leaves of a streamed job that ended: its deltas, the closing entry, the hash."""
    for delta in [TokenDelta(offset=0, text="a", token_ids=[1]),
                  TokenDelta(offset=1, text="bc", token_ids=[2, 3], finish_reason="length")]:
        redis_client.xadd(K.tokens(job_id), delta.to_fields())
    redis_client.hset(K.job(job_id), mapping={"status": "done", "result": json.dumps(
        {"id": job_id, "text": "abc", "outputs": [{"text": "abc", "token_ids": [1, 2, 3], "finish_reason": "length"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 3}})})
    redis_client.rpush(K.done(job_id), "done")


OUTAGE_S = 3.0  # longer than redis-py's own retries of a command (a few, under a second)


def test_a_stream_rides_an_outage_that_starts_at_its_last_read(redis_server_factory):
    """The server goes away just as a finished stream's last read is sent (a Sentinel failover
    did this in CI) and is back 3 s later: the stream waits it out and ends, every token once."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with Client(server.url) as client:
        job_id = client.submit("x", stream=True)
        finished_stream(client.redis, job_id)
        real_xread, reads = client.redis.xread, []

        def xread(*args, **kwargs):
            reads.append(args)
            if len(reads) == 2:  # the read after the closing entry
                server.stop()
                threading.Timer(OUTAGE_S, server.start).start()
            return real_xread(*args, **kwargs)

        client.redis.xread = xread
        started = time.monotonic()
        read = list(client.stream_deltas(job_id, timeout=30))
        assert time.monotonic() - started >= OUTAGE_S - 0.5  # it did wait the outage out
        assert [d.token_ids for d in read] == [[1], [2, 3]] and len(reads) > 2


def test_status_rides_an_outage(redis_server_factory):
    """A web app polling ``status`` through a Redis restart gets the status, not ConnectionError."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with Client(server.url) as client:
        job_id = client.submit("x")
        server.stop()
        threading.Timer(OUTAGE_S, server.start).start()
        started = time.monotonic()
        assert client.status(job_id).status is Status.QUEUED
        assert time.monotonic() - started >= OUTAGE_S - 0.5


def first_reply_lost(script, calls: list):
    """``script`` whose first call runs but loses its reply (the connection drops after the
    write), as a ConnectionError; ``calls`` counts the calls."""
    def call(*args, **kwargs):
        calls.append(1)
        value = script(*args, **kwargs)
        if len(calls) == 1:
            raise redis.ConnectionError("Connection closed by server.")
        return value

    return call


def test_submit_rides_an_outage(redis_server_factory):
    """A web app submitting through a Redis restart gets its id once the server is back, and
    each job is queued once."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with Client(server.url) as client:
        client.queues()  # connected before the server goes
        server.stop()
        threading.Timer(OUTAGE_S, server.start).start()
        started = time.monotonic()
        job_id = client.submit("x")
        assert time.monotonic() - started >= OUTAGE_S - 0.5  # it did wait the outage out
        server.stop()
        threading.Timer(OUTAGE_S, server.start).start()
        many = client.submit_many([{"prompt": f"y{i}"} for i in range(3)])
        assert client.status(job_id).status is Status.QUEUED
        assert all(client.status(i).status is Status.QUEUED for i in many)
        assert client.queues()["interactive"].backlog == 4


def test_a_submission_whose_reply_is_lost_is_queued_once(redis_server_factory):
    """The script ran but its reply never came (the connection dropped after the write): the
    retry finds the id already there and queues nothing more."""
    server = redis_server_factory()
    with Client(server.url) as client:
        calls = []
        client._submit_script = first_reply_lost(client._submit_script, calls)
        job_id = client.submit("x", job_id="once")
        assert job_id == "once" and len(calls) == 2
        assert client.queues()["interactive"].backlog == 1


def test_cancel_rides_an_outage_and_a_lost_reply(redis_server_factory):
    """A cancel sent through a Redis restart cancels the job; one whose reply is lost after the
    script ran reports the job cancelled (its retry finds it so), not already ended."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with Client(server.url) as client:
        first, second, third = client.submit("x"), client.submit("y"), client.submit("z")
        server.stop()
        threading.Timer(OUTAGE_S, server.start).start()
        started = time.monotonic()
        assert client.cancel(first) is True
        assert time.monotonic() - started >= OUTAGE_S - 0.5
        assert client.status(first).status is Status.CANCELLED
        real, calls = client._cancel_script, []
        client._cancel_script = first_reply_lost(real, calls)
        assert client.cancel(second) is True and len(calls) == 2
        assert client.status(second).status is Status.CANCELLED
        client._cancel_script = real
        assert client.cancel(second) is False  # ended before this call: as without an outage
        assert client.status(third).status is Status.QUEUED
