"""What a client does when Redis cuts a wait short or refuses a submission."""

import threading
import time

import pytest
import redis

from producers.client import Client
from producers.errors import Timeout
from producers.jobs import block_chunk
from producers.protocol import Keys
from tests.producers.peer import Peer

K = Keys("sluiceway")


def test_the_shortest_wait_chunk_never_asks_redis_to_block_forever(redis_server):
    # A wait with a sliver of time left must still come back: Redis reads a block that
    # rounds to 0 ms as "forever", which would overrun the caller by the socket timeout.
    r = redis.Redis.from_url(redis_server, socket_timeout=3)
    started = time.monotonic()
    assert r.blmove("empty", "empty", block_chunk(1e-6, None), "RIGHT", "LEFT") is None
    assert time.monotonic() - started < 1.5
    r.close()


def test_a_submission_redis_refuses_leaves_no_job_behind(client, redis_server):
    # A queue whose last entry id is the largest possible takes no new entry ('*' cannot
    # grow past it): the XADD fails, and no hash may stay behind saying "queued" forever.
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    r.xadd(K.queue("interactive"), {"job": "{}"}, id="18446744073709551615-18446744073709551615")
    with pytest.raises(redis.ResponseError, match="last possible ID"):
        client.submit("hello", job_id="refused-1")
    assert r.exists(K.job("refused-1")) == 0
    r.close()


def _unblock_every_blocked_client(r: redis.Redis) -> int:
    """``CLIENT UNBLOCK id ERROR`` for each blocked client: what a primary demoted by a planned
    failover does to them (they read ``-UNBLOCKED ...``)."""
    ids = [int(c["id"]) for c in r.client_list() if "b" in c["flags"]]
    return sum(r.execute_command("CLIENT", "UNBLOCK", i, "ERROR") for i in ids)


@pytest.mark.parametrize("wait", ["result", "stream", "async result", "async stream"])
def test_a_wait_the_server_lets_go_unblocked_waits_again(redis_server, peer, wait):
    """The clients' own blocking reads (``result``'s BLMOVE, ``stream``'s XREAD) retry an
    ``UNBLOCKED`` reply as they retry a dropped connection, instead of raising it."""
    import asyncio
    import threading

    from producers.aio import AsyncClient
    from producers.client import Client

    client = Client(redis_server)
    job_id = client.submit("a", stream=True)
    client.close()
    got: list = []

    def run() -> None:
        if wait.startswith("async"):
            async def main():
                c = AsyncClient(redis_server)
                try:
                    if wait.endswith("result"):
                        got.append((await c.result(job_id, timeout=20)).text)
                    else:
                        got.append("".join([t async for t in c.stream(job_id, timeout=20)]))
                finally:
                    await c.close()
            asyncio.run(main())
            return
        with Client(redis_server) as c:
            got.append(c.result(job_id, timeout=20).text if wait == "result" else "".join(c.stream(job_id, timeout=20)))

    def guarded() -> None:
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            got.append(exc)

    thread = threading.Thread(target=guarded)
    thread.start()
    peer.wait_blocked(1)
    assert _unblock_every_blocked_client(peer.redis) == 1
    peer.wait_blocked(1)  # blocked again, not raised
    peer.token(job_id, "Paris.", finish_reason="stop")
    peer.finish(job_id)
    thread.join(20)
    assert got == ["Paris."]


def test_a_wait_with_a_timeout_ends_by_it_while_redis_is_away(redis_server_factory):
    """A web app's ``result`` / ``stream`` with timeout=1 against a Redis that has gone: the
    connection error comes at the timeout, not after the 30 s outage window."""
    server = redis_server_factory()
    with Client(server.url) as client:
        job_id = client.submit("x", stream=True)
        server.stop()
        for wait in (lambda: client.result(job_id, timeout=1), lambda: list(client.stream(job_id, timeout=1)),
                     lambda: client.result(job_id, timeout=0)):
            started = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                wait()
            assert time.monotonic() - started < 2.5


def test_a_wait_an_outage_cut_short_times_out_on_time(redis_server_factory):
    """Redis goes away for 2 s while ``result(timeout=4)`` is blocked and comes back: the wait
    resumes with the time it has left, so the Timeout comes at 4 s, not 2 s + another 4."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    with Client(server.url) as client:
        job_id = client.submit("never finished")
        peer = Peer(server.url)

        def outage():
            peer.wait_blocked(1)
            peer.close()
            server.stop()
            time.sleep(2)
            server.start()

        thread = threading.Thread(target=outage)
        thread.start()
        started = time.monotonic()
        with pytest.raises(Timeout):
            client.result(job_id, timeout=4)
        assert 3.9 <= time.monotonic() - started < 5
        thread.join()


def test_bad_wait_cancel_and_submit_many_arguments_are_refused_naming_them(client):
    """A timeout that is not a number, a cancel TTL under a second (``result_ttl=0`` made a queued
    job vanish: ``status`` then said unknown, not cancelled), one job or None where
    ``submit_many`` wants a list of them: each refused before Redis sees it, naming the argument."""
    from producers.errors import InvalidJob
    from producers.protocol import Status

    job_id = client.submit("x", stream=True)
    with pytest.raises(TypeError, match="timeout: expected seconds .* got str '5'"):
        client.result(job_id, timeout="5")
    with pytest.raises(ValueError, match="timeout: .* got NaN"):
        list(client.stream(job_id, timeout=float("nan")))
    for name, value in (("ttl", 0), ("result_ttl", 0), ("result_ttl", -5), ("ttl", "a"), ("ttl", True)):
        with pytest.raises(ValueError, match=f"^{name}: expected whole seconds >= 1, got {value!r}"):
            client.cancel(job_id, **{name: value})
    assert client.status(job_id).status is Status.QUEUED
    with pytest.raises(Timeout):
        client.result(job_id, timeout=-1)  # a budget already spent: one look, no wait
    for jobs, message in (([None], "job 0: expected a Job or a dict of submit"), (["abc"], "job 0: expected a Job"),
                          ("abc", "jobs: expected an iterable of jobs, got one str"),
                          ({"prompt": "y"}, "jobs: expected an iterable of jobs, got one dict")):
        with pytest.raises(InvalidJob, match=message):
            client.submit_many(jobs)
    assert client.queues()["interactive"].backlog == 1
    assert client.cancel(job_id, ttl=60.0, result_ttl=3600) is True
