"""The shared stream reader (``AsyncClient(shared_streams=True)``) on a real redis-server."""

import asyncio
import time

import redis

from producers.aio import AsyncClient
from tests.worker.conftest import wait_for

STREAMS = 50


def _xread_blocked(r: redis.Redis) -> bool:
    return any(c["cmd"] == "xread" and "b" in c["flags"] for c in r.client_list())


def test_one_read_serves_many_streams_a_new_one_at_once_and_close_ends_it(redis_server):
    r = redis.Redis.from_url(redis_server, decode_responses=True)

    async def main():
        client = AsyncClient(redis_server, shared_streams=True, socket_timeout=120)
        reader = client.streams
        tails = [reader.follow(f"t:{i}") for i in range(STREAMS)]
        assert reader.follow("t:0") is None  # followed already: that caller reads on its own
        for i in range(STREAMS):
            r.xadd(f"t:{i}", {"n": str(i)})
        for i, tail in enumerate(tails):
            entries = await reader.take(tail, 10)
            assert [fields for _, fields in entries] == [{"n": str(i)}]
        assert reader.commands < STREAMS / 5, f"{reader.commands} XREADs for {STREAMS} streams"
        await asyncio.to_thread(wait_for, lambda: _xread_blocked(r), 10, "the read blocked on 50 silent streams")
        late = reader.follow("t:late")  # the block (60 s) ends for it
        r.xadd("t:late", {"n": "late"})
        started = time.monotonic()
        assert [fields for _, fields in await reader.take(late, 30)] == [{"n": "late"}]
        assert time.monotonic() - started < 10
        reader.leave(tails[1])
        r.xadd("t:1", {"n": "gone"})
        r.xadd("t:2", {"n": "two"})
        assert [fields for _, fields in await reader.take(tails[2], 10)] == [{"n": "two"}]
        assert tails[1].entries == []  # a stream left is read no more
        await asyncio.to_thread(wait_for, lambda: _xread_blocked(r), 10, "the read blocked again")
        started = time.monotonic()
        await client.close()  # ends the blocked read at once
        assert time.monotonic() - started < 5
        await asyncio.to_thread(wait_for, lambda: not _xread_blocked(r), 10, "the read gone")

    asyncio.run(main())
    r.close()



def test_a_read_the_server_lets_go_unblocked_is_read_again_and_no_follower_sees_an_error(redis_server):
    """A blocked read can come back ``-UNBLOCKED ...``: a primary demoted by a planned failover
    lets its blocked clients go so, and so does ``CLIENT UNBLOCK id ERROR``. The reader reads
    again; the streams it serves go on."""
    r = redis.Redis.from_url(redis_server, decode_responses=True)

    def blocked_read_id() -> int | None:
        return next((int(c["id"]) for c in r.client_list() if c["cmd"] == "xread" and "b" in c["flags"]), None)

    async def main():
        client = AsyncClient(redis_server, shared_streams=True, socket_timeout=120)
        reader = client.streams
        tail = reader.follow("u:1")
        read_id = await asyncio.to_thread(wait_for, blocked_read_id, 10, "the read blocked")
        assert r.execute_command("CLIENT", "UNBLOCK", read_id, "ERROR") == 1
        await asyncio.to_thread(wait_for, blocked_read_id, 10, "the read blocked again")
        r.xadd("u:1", {"n": "after"})
        assert [fields for _, fields in await reader.take(tail, 10)] == [{"n": "after"}]
        assert tail.error is None
        await client.close()

    asyncio.run(main())
    r.close()
