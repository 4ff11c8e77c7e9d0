"""AsyncClient: the same protocol behaviour as Client, over redis.asyncio."""

import asyncio
import time

import pytest

from producers.aio import AsyncClient
from producers.errors import InvalidJob, JobCancelled, JobFailed, JobNotFound, Timeout
from producers.protocol import Keys, Status, parse_job

K = Keys("sluiceway")


def run(coro):
    return asyncio.run(coro)


def test_submit_status_and_result(redis_server, peer):
    async def main():
        async with AsyncClient(redis_server) as client:
            job_id = await client.submit("hi", sampling={"max_tokens": 4}, metadata={"row": 2})
            (_, fields), = peer.redis.xrange(K.queue("interactive"))
            assert parse_job(fields["job"]).id == job_id
            assert (await client.status(job_id)).status is Status.QUEUED
            waiter = asyncio.create_task(client.result(job_id, timeout=10))
            await asyncio.to_thread(peer.wait_blocked, 1)
            await asyncio.to_thread(peer.finish, job_id)
            assert (await waiter).text == "Paris."
            assert (await client.result(job_id)).text == "Paris."  # the signal stays
            assert (await client.status(job_id)).status is Status.DONE

    run(main())


def test_submit_many_and_known_ids(redis_server):
    async def main():
        async with AsyncClient(redis_server, queue="bulk") as client:
            ids = await client.submit_many([{"prompt": f"q{i}", "id": f"row-{i}"} for i in range(2500)])
            assert ids[:2] == ["row-0", "row-1"]
            await client.submit_many([{"prompt": "q0", "id": "row-0"}])
            assert await client.redis.xlen(K.queue("bulk")) == 2500
            with pytest.raises(InvalidJob, match="job 1: "):
                await client.submit_many([{"prompt": "a"}, {"prompt": "", "messages": []}])

    run(main())


def test_failures_timeouts_and_unknown_jobs(redis_server, peer):
    async def main():
        async with AsyncClient(redis_server) as client:
            with pytest.raises(JobNotFound):
                await client.status("nope")
            job_id = await client.submit("hi")
            start = time.monotonic()
            with pytest.raises(Timeout):
                await client.result(job_id, timeout=0.2)
            assert time.monotonic() - start < 5
            peer.finish(job_id, Status.FAILED, error="model error: boom")
            with pytest.raises(JobFailed, match="boom"):
                await client.result(job_id)

    run(main())


def test_stream_and_cancel(redis_server, peer):
    async def main():
        async with AsyncClient(redis_server) as client:
            job_id = await client.submit("hi", stream=True)
            peer.token(job_id, "Hel")

            async def rest():
                await asyncio.to_thread(peer.wait_blocked, 1)
                peer.token(job_id, "lo", finish_reason="length")
                peer.finish(job_id)

            task = asyncio.create_task(rest())
            assert [t async for t in client.stream(job_id, timeout=10)] == ["Hel", "lo"]
            await task

            queued = await client.submit("hi", stream=True)
            assert await client.cancel(queued) is True  # no worker started it: it ends now
            with pytest.raises(JobCancelled):
                [t async for t in client.stream(queued, timeout=5)]
            assert await client.cancel(queued) is False

            running = await client.submit("hi", stream=True)
            peer.start(running)
            assert await client.cancel(running) is True
            assert await client.redis.get(K.cancel(running)) == "1"  # for its worker to see
            peer.token(running, "", finish_reason="cancelled")
            peer.finish(running, Status.CANCELLED)
            with pytest.raises(JobCancelled):
                [t async for t in client.stream(running, timeout=5)]
            assert await client.cancel(running) is False

    run(main())


def test_stream_of_a_job_without_stream_waits_on_the_done_signal(redis_server, peer):
    async def main():
        async with AsyncClient(redis_server) as client:
            job_id = await client.submit("hi")

            async def read():
                return [t async for t in client.stream(job_id, timeout=10)]

            reader = asyncio.create_task(read())
            await asyncio.to_thread(peer.wait_blocked, 1)
            waiting = [c["cmd"] for c in peer.redis.client_list() if c["cmd"] in ("blmove", "xread", "blpop")]
            assert waiting == ["blmove"]
            await asyncio.to_thread(peer.finish, job_id)
            assert await reader == ["Paris."]

    run(main())


def test_stream_reads_by_offset_every_token_once(redis_server):
    """A repeated entry and a resumed run's deltas are read once each, as by ``Client``."""
    import json

    from producers.protocol import TokenDelta

    keys = Keys()

    async def main():
        async with AsyncClient(redis_server) as client:
            job_id = await client.submit("x", stream=True)
            for delta in [TokenDelta(offset=0, text="a", token_ids=[1]), TokenDelta(offset=0, text="a", token_ids=[1]),
                          TokenDelta(offset=1, text="bc", token_ids=[2, 3], finish_reason="length")]:
                await client.redis.xadd(keys.tokens(job_id), delta.to_fields())
            await client.redis.hset(keys.job(job_id), mapping={"status": "done", "result": json.dumps(
                {"id": job_id, "text": "abc", "outputs": [{"text": "abc", "token_ids": [1, 2, 3],
                                                          "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 3}})})
            await client.redis.rpush(keys.done(job_id), "done")
            read = [d async for d in client.stream_deltas(job_id, timeout=5)]
            assert [d.token_ids for d in read] == [[1], [2, 3]]
            assert "".join([t async for t in client.stream(job_id, timeout=5)]) == "abc"

    run(main())


def test_a_stream_rides_an_outage_that_starts_at_its_last_read(redis_server_factory):
    """As ``Client``'s: the server goes away as a finished stream's last read is sent and is back
    3 s later; the stream waits it out and ends with every token once."""
    import threading

    from tests.producers.test_client import OUTAGE_S, finished_stream

    server = redis_server_factory(appendonly=True, appendfsync="always")
    with server.client(decode_responses=True) as admin:
        job_id = "0" * 32
        admin.hset(K.job(job_id), "stream", "1")
        finished_stream(admin, job_id)

    async def main():
        async with AsyncClient(server.url) as client:
            real_xread, reads = client.redis.xread, []

            async def xread(*args, **kwargs):
                reads.append(args)
                if len(reads) == 2:  # the read after the closing entry
                    server.stop()
                    threading.Timer(OUTAGE_S, server.start).start()
                return await real_xread(*args, **kwargs)

            client.redis.xread = xread
            started = time.monotonic()
            read = [d async for d in client.stream_deltas(job_id, timeout=30)]
            assert time.monotonic() - started >= OUTAGE_S - 0.5
            assert [d.token_ids for d in read] == [[1], [2, 3]] and len(reads) > 2

    run(main())


def test_status_rides_an_outage(redis_server_factory):
    import threading

    from tests.producers.test_client import OUTAGE_S

    server = redis_server_factory(appendonly=True, appendfsync="always")

    async def main():
        async with AsyncClient(server.url) as client:
            job_id = await client.submit("x")
            server.stop()
            threading.Timer(OUTAGE_S, server.start).start()
            started = time.monotonic()
            assert (await client.status(job_id)).status is Status.QUEUED
            assert time.monotonic() - started >= OUTAGE_S - 0.5

    run(main())


def test_a_wait_with_a_timeout_ends_by_it_while_redis_is_away(redis_server_factory):
    """As ``Client``'s: with Redis gone, ``result`` / ``stream`` with timeout=1 raise the
    connection error at the timeout, not after the 30 s outage window."""
    import redis

    server = redis_server_factory()

    async def main():
        async with AsyncClient(server.url) as client:
            job_id = await client.submit("x", stream=True)
            server.stop()

            async def streamed():
                return [text async for text in client.stream(job_id, timeout=1)]

            for wait in (lambda: client.result(job_id, timeout=1), streamed):
                started = time.monotonic()
                with pytest.raises(redis.ConnectionError):
                    await wait()
                assert time.monotonic() - started < 2.5

    run(main())


def test_a_wait_an_outage_cut_short_times_out_on_time(redis_server_factory):
    """As ``Client``'s: a 2 s outage during ``result(timeout=4)``; the Timeout comes at 4 s."""
    import threading

    from tests.producers.peer import Peer

    server = redis_server_factory(appendonly=True, appendfsync="always")
    peer = Peer(server.url)

    def outage():
        peer.wait_blocked(1)
        peer.close()
        server.stop()
        time.sleep(2)
        server.start()

    async def main():
        async with AsyncClient(server.url) as client:
            job_id = await client.submit("never finished")
            thread = threading.Thread(target=outage)
            thread.start()
            started = time.monotonic()
            with pytest.raises(Timeout):
                await client.result(job_id, timeout=4)
            assert 3.9 <= time.monotonic() - started < 5
            thread.join()

    run(main())


def test_bad_wait_and_cancel_arguments_are_refused_naming_them(redis_server):
    async def main():
        async with AsyncClient(redis_server) as client:
            job_id = await client.submit("x", stream=True)
            with pytest.raises(TypeError, match="timeout: expected seconds"):
                await client.result(job_id, timeout="5")
            with pytest.raises(ValueError, match="timeout: .* got NaN"):
                [d async for d in client.stream(job_id, timeout=float("nan"))]
            with pytest.raises(ValueError, match="^result_ttl: expected whole seconds >= 1, got 0"):
                await client.cancel(job_id, result_ttl=0)
            assert (await client.status(job_id)).status is Status.QUEUED

    run(main())


def reply_lost_once(script, calls: list):
    """``script`` whose first call runs but loses its reply (the connection drops after the
    write), as a ConnectionError; ``calls`` counts the calls."""
    import redis

    async def call(*args, **kwargs):
        calls.append(1)
        value = await script(*args, **kwargs)
        if len(calls) == 1:
            raise redis.ConnectionError("Connection closed by server.")
        return value

    return call


def test_submit_submit_many_and_cancel_ride_an_outage_within_their_bounds(redis_server_factory):
    """As ``Client``'s: a submit, a submit_many and a cancel sent while Redis restarts are
    answered once it is back, each job queued once; submit_many's timeout ends its ride."""
    import threading

    import redis

    server = redis_server_factory(appendonly=True, appendfsync="always")
    outage_s = 0.6  # redis-py 8 fails a refused connection at once: all of it is the client's ride

    async def main():
        async with AsyncClient(server.url) as client:
            doomed = await client.submit("x")
            server.stop()
            threading.Timer(outage_s, server.start).start()
            started = time.monotonic()
            one, many, cancelled = await asyncio.gather(
                client.submit("y", job_id="once"), client.submit_many([{"prompt": f"z{i}"} for i in range(3)]),
                client.cancel(doomed))
            assert time.monotonic() - started >= outage_s - 0.2  # it did wait the outage out
            assert one == "once" and cancelled is True
            assert (await client.status(doomed)).status is Status.CANCELLED
            assert [(await client.status(i)).status for i in [one, *many]] == [Status.QUEUED] * 4
            assert await client.redis.xlen(K.queue("interactive")) == 4
            server.stop()
            started = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                await client.submit_many([{"prompt": "late"}], timeout=0.3)
            assert time.monotonic() - started < 1

    run(main())


def test_a_submission_or_cancel_whose_reply_is_lost_is_sent_again_harmlessly(redis_server):
    """The script ran but its reply never came: the submission's retry queues nothing more, the
    cancel's finds the job cancelled and counts it as its own (True)."""
    async def main():
        async with AsyncClient(redis_server) as client:
            calls: list = []
            client._submit_script = reply_lost_once(client._submit_script, calls)
            assert await client.submit("x", job_id="once") == "once" and len(calls) == 2
            assert await client.redis.xlen(K.queue("interactive")) == 1
            real, calls = client._cancel_script, []
            client._cancel_script = reply_lost_once(real, calls)
            assert await client.cancel("once") is True and len(calls) == 2
            client._cancel_script = real
            assert await client.cancel("once") is False  # ended before this call: as without an outage
            assert (await client.status("once")).status is Status.CANCELLED

    run(main())


def test_results_answer_in_order_see_any_job_fail_within_a_look_and_ride_an_outage(redis_server_factory):
    """``results``: one blocked wait for several jobs, their answers in order whatever order they
    end in; a job that fails while an earlier one is waited on raises within ``RESULTS_WATCH_S``;
    Redis restarting mid-wait is ridden."""
    from producers.jobs import RESULTS_WATCH_S
    from tests.producers.peer import Peer, result_for

    server = redis_server_factory(appendonly=True, appendfsync="always")
    peer = Peer(server.url)

    async def main():
        async with AsyncClient(server.url) as client:
            ids = await client.submit_many([{"prompt": f"q{i}"} for i in range(3)])
            waiter = asyncio.create_task(client.results(ids, timeout=30))
            await asyncio.to_thread(peer.wait_blocked, 1)
            for job_id in reversed(ids):
                peer.finish(job_id, result=result_for(job_id, job_id))
            assert [r.text for r in await waiter] == ids

            ids = await client.submit_many([{"prompt": f"f{i}"} for i in range(3)])
            waiter = asyncio.create_task(client.results(ids, timeout=30))
            await asyncio.to_thread(peer.wait_blocked, 1)
            started = time.monotonic()
            peer.finish(ids[2], Status.FAILED, error="model error: boom")  # the wait is on ids[0]
            with pytest.raises(JobFailed, match="boom"):
                await waiter
            assert time.monotonic() - started < RESULTS_WATCH_S + 0.5
            assert peer.blocked_clients() == 0

            ids = await client.submit_many([{"prompt": f"o{i}"} for i in range(2)])
            waiter = asyncio.create_task(client.results(ids, timeout=30))
            await asyncio.to_thread(peer.wait_blocked, 1)
            peer.close()
            server.stop()
            await asyncio.to_thread(server.start)  # the wait meets the refused connections meanwhile
            back = Peer(server.url)
            for job_id in ids:
                back.finish(job_id, result=result_for(job_id, job_id))
            assert [r.text for r in await waiter] == ids
            back.close()

    run(main())
